"""Scheduler and block manager with toy sizes (no model)."""

from __future__ import annotations

from hotstart.engine.block_manager import BlockManager
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.sampling_params import SamplingParams


def seq(rid: str, n_prompt: int) -> Sequence:
    return Sequence(rid, list(range(n_prompt)), n_prompt, SamplingParams(max_tokens=100))


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the forward ran: tokens computed, and one token sampled where due."""
    batch = s.schedule()
    for q, n in batch:
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
    return [(q.request_id, n) for q, n in batch]


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", 5)
    bm.allocate(a, 5)
    assert a.block_table == [1, 2] and bm.num_free == 2  # id 0 is the null block, never handed out
    bm.allocate(a, 8)  # still fits in 2 blocks
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_used == 3
    assert not bm.can_allocate(seq("b", 8), 8)
    bm.free(a)
    assert bm.num_free == 4 and a.block_table == [] and a.num_computed_tokens == 0


def test_prefill_then_decode_and_token_budget():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq("a", 6), seq("b", 7)
    s.add(a)
    s.add(b)
    # step 1: a's whole prompt (6) + the first 4 tokens of b (chunked prefill)
    assert run_step(s) == [("a", 6), ("b", 4)]
    # step 2: a decodes 1 token, b finishes its prompt (3)
    assert run_step(s) == [("a", 1), ("b", 3)]
    assert run_step(s) == [("a", 1), ("b", 1)]
    assert a.num_generated == 3 and b.num_generated == 2


def test_max_num_seqs_and_new_requests_join_between_steps():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add(seq(rid, 3))
    assert [r for r, _ in run_step(s)] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]
    s.remove(s.running[0])  # a finishes
    assert [r for r, _ in run_step(s)] == ["b", "c"]


def test_preemption_when_cache_is_full_and_recompute():
    s = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 3)
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 4), ("b", 3)]  # 2 + 2 blocks: the cache is full
    # a needs a 3rd block for its next token: b (admitted last) is preempted and requeued
    assert run_step(s) == [("a", 1)]
    assert s.num_preemptions == 1 and list(s.waiting) == [b] and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_generated == 1  # keeps its sampled token
    s.remove(a)
    # b is recomputed from scratch: prompt + its generated token
    assert run_step(s) == [("b", 4)]


def test_waiting_request_waits_for_free_blocks():
    s = Scheduler(BlockManager(3, 4), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 8)]  # b does not fit (needs 2 blocks, 1 free)
    assert list(s.waiting) == [b]
    s.remove(a)
    assert run_step(s) == [("b", 8)]
