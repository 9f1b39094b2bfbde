"""Continuous batching: which sequences run this step and how many of their tokens.

Every step has a token budget. Running sequences go first (a decode is 1 token; an unfinished chunked
prefill continues); waiting sequences join while budget, sequence slots and KV blocks allow. When a
running sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed and it is recomputed later (it keeps its generated tokens).
A decoding sequence with a draft (speculative decoding, engine/spec_decode.py) computes its last token
and the draft, as far as the budget and the free blocks allow: a draft is cut, never a reason to preempt.
A waiting sequence starts from its longest cached prefix (BlockManager.lookup) when prefix caching is
on; a request of n choices takes n sequence slots from admission (its choices are forked later).
A gate (engine/kv_store.py, the prefix cache on disk) may hold a new sequence until the blocks of its
prefix are read back from disk.
"""

from __future__ import annotations

from collections import deque

from hotstart.engine.block_manager import BlockManager
from hotstart.engine.sequence import Sequence

ADMIT_WAIT_S = 0.005  # with nothing else to run, a step waits this long for a gate's read (GIL released)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.gate = None  # PrefixStore (engine/kv_store.py): hold(seq, then), admit(wait), cancel(seq)

    def add(self, seq: Sequence) -> None:
        if self.gate is None or not self.gate.hold(seq, self.waiting.append):
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.gate is not None and self.gate.pending))

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if self.gate is not None:
            self.gate.cancel(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft = []
        self.blocks.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def add_running(self, seq: Sequence) -> None:
        """A choice forked from a running sequence (its slot was reserved when the request was admitted)."""
        self.running.append(seq)

    @staticmethod
    def _chunk(seq: Sequence, start: int, budget: int) -> int:
        n = min(seq.num_tokens - start, budget)
        return min(n, seq.max_chunk) if seq.max_chunk else n

    def _with_draft(self, seq: Sequence, n: int, budget: int) -> int:
        """N (1: a decode) plus the part of SEQ's draft that the budget and the free blocks take (the
        draft is cut to it)."""
        k = min(len(seq.draft), budget - n) if n == 1 else 0
        while k > 0 and not self.blocks.can_allocate(seq, seq.num_computed_tokens + n + k):
            k -= 1
        del seq.draft[max(k, 0):]
        return n + len(seq.draft)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """[(sequence, number of new tokens to compute this step)], running ones first."""
        if self.gate is not None and self.gate.pending:
            self.gate.admit(0.0 if self.waiting or self.running else ADMIT_WAIT_S)
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below by an earlier sequence
                continue
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if seq.draft:
                n = self._with_draft(seq, n, budget)
            if n <= 0:
                continue
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append((seq, n))
            budget -= n
        slots = sum(s.num_slots for s in self.running)
        while self.waiting and budget > 0 and slots + self.waiting[0].num_slots <= self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.lookup(seq)
            start = len(hits) * self.blocks.block_size
            n = self._chunk(seq, start, budget)
            if not self.blocks.can_allocate(seq, start + n, hits):
                break
            self.waiting.popleft()
            self.blocks.count_query(seq, hits)
            self.blocks.allocate(seq, start + n, hits)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            slots += seq.num_slots
        return scheduled
