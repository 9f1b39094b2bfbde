"""Fixed-size KV-cache blocks: refcounted, shared between choices, content-hashed for prefix caching.

- Refcounts: the n choices of a request share its prompt's blocks (fork()). A shared block that is only
  partly filled is copied before a choice writes into it (copy-on-write: allocate() queues (src, dst)
  in pending_copies, the runner copies them before the step's forward).
- Prefix caching (vLLM v1's scheme): a full block is identified by a hash chain over token ids,
  hash(parent block's hash, this block's token ids), so equal hashes mean equal prefixes and equal K/V.
  Computed full blocks are registered (cache_full_blocks); a new sequence starts from the longest
  chain of cached blocks (lookup) and computes only the rest, always at least its last token (its
  logits are needed). A freed block keeps its hash and contents until it is handed out again.
- Sliding windows (issue 23): when every layer of the model slides (Mistral), a block wholly behind the
  window of every query to come is released as the sequence grows (allocate()), so a long generation
  holds O(window) blocks. Its table entry becomes the null block 0: positions keep their index, the
  window mask never lets attention read it. A released block keeps its prefix-cache hash (its K/V are
  still those of its prefix) and is handed out again like any freed block.
- Free blocks form one LRU queue: blocks without a hash are handed out first, then cached ones,
  least recently freed first (a sequence's later blocks before its earlier ones).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from hotstart.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def freeable_window(layer_windows: Seq[int | None]) -> int | None:
    """The window behind which KV blocks may be released: the widest of LAYER_WINDOWS when every layer
    slides (None, attending to every key, on any layer keeps every block: Gemma's global layers)."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """The prefix-cache key of a full block: its token ids chained to the key of the block before it."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Hands out block ids 1..num_blocks; id 0 is the runner's always-zero null block (padding reads it)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # the sliding window of every layer (None: some layer sees every key)
        self.ref = [0] * (num_blocks + 1)
        self.hash_of: list[bytes | None] = [None] * (num_blocks + 1)
        # freed blocks (id -> None) in hand-out order: those without a hash at the front, then cached ones
        # least recently freed first; ids from _fresh on were never handed out (no O(blocks) setup)
        self._free: OrderedDict[int, None] = OrderedDict()
        self._fresh = 1
        self._cached: dict[bytes, int] = {}  # full-block hash -> block id holding that content
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), for the runner
        self.cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.cache_hits = 0  # of which found there
        self.registered = 0  # blocks ever registered in the prefix cache (the disk store's "anything new")

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks + 1 - self._fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    # --- prefix cache -----------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """SEQ's hash chain over its first NUM_BLOCKS full blocks (kept on the sequence, extended)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else b"", seq.token_ids[j * bs:(j + 1) * bs]))
        return hashes

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks SEQ (holding no blocks) can start from, longest prefix first; no side effects.
        At most (num_tokens - 1) // block_size: the last token is always computed."""
        if not self.enable_prefix_caching or seq.skip_prefix_cache or seq.block_table:
            return []
        hits: list[int] = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register SEQ's blocks that are full of computed tokens (called after each step)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for j in range(seq.num_cached_blocks, full):
            block, h = seq.block_table[j], hashes[j]
            if block and self.hash_of[block] is None and h not in self._cached:
                self._cached[h] = block
                self.hash_of[block] = h
                self.registered += 1
        seq.num_cached_blocks = full

    def restore(self, h: bytes) -> int | None:
        """A block for content H read back from disk (engine/kv_store.py; the caller writes its K/V),
        registered as a cached free block, the most recently freed; None when none is free."""
        if self.num_free == 0:
            return None
        block = self._pop_free()
        self.ref[block] = 0
        self.hash_of[block], self._cached[h] = h, block
        self._free[block] = None
        return block

    def touch(self, h: bytes) -> None:
        """Cached content H, if its block is free, becomes the most recently freed (evicted last)."""
        block = self._cached.get(h)
        if block is not None and block in self._free:
            self._free.move_to_end(block)

    # --- allocation -------------------------------------------------------------------------
    def _cow_needed(self, seq: Sequence) -> bool:
        """Will SEQ's next token go into a partly filled block it shares with another choice?"""
        j, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset > 0 and j < len(seq.block_table) and self.ref[seq.block_table[j]] > 1

    def blocks_needed(self, seq: Sequence, num_tokens: int, hits: Seq[int] = ()) -> int:
        """Free blocks SEQ takes to hold NUM_TOKENS tokens in total (starting from HITS if it holds none)."""
        held = len(seq.block_table) + len(hits)
        need = max(0, blocks_for(num_tokens, self.block_size) - held)
        revived = sum(1 for b in hits if self.ref[b] == 0)  # cached blocks that sit in the free queue
        released = sum(1 for j in self._behind_window(seq) if self.ref[seq.block_table[j]] == 1)
        return need + revived + self._cow_needed(seq) - released

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: Seq[int] = ()) -> bool:
        return self.blocks_needed(seq, num_tokens, hits) <= self.num_free

    def _pop_free(self) -> int:
        block = next(iter(self._free)) if self._free else None
        if block is None or (self.hash_of[block] is not None and self._fresh <= self.num_blocks):
            block = self._fresh  # never used before: preferred to evicting a cached block
            self._fresh += 1
        else:
            del self._free[block]
            h = self.hash_of[block]
            if h is not None:  # evict: its content is about to be overwritten
                if self._cached.get(h) == block:
                    del self._cached[h]
                self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def _behind_window(self, seq: Sequence) -> list[int]:
        """Indices of SEQ's blocks no query to come can see, not released yet. The next query sits at
        position c = num_computed_tokens or later and sees keys from c - W + 1 on: block j is behind once
        (j + 1) * block_size <= c - W + 1. Released blocks (0) form a prefix of the table."""
        if self.window is None:
            return []
        table = seq.block_table
        j = min((seq.num_computed_tokens - self.window + 1) // self.block_size, len(table)) - 1
        behind = []
        while j >= 0 and table[j]:
            behind.append(j)
            j -= 1
        return behind

    def allocate(self, seq: Sequence, num_tokens: int, hits: Seq[int] = ()) -> None:
        """Give SEQ blocks for NUM_TOKENS tokens in total. HITS (from lookup(), for a sequence holding
        no blocks) become its first blocks and its computed tokens. Blocks behind every layer's window
        are released first (the sequence's table keeps 0 in their place)."""
        need = self.blocks_needed(seq, num_tokens, hits)
        if need > self.num_free:
            raise RuntimeError(f"KV cache: {need} blocks needed, {self.num_free} free")
        if hits:
            for b in hits:
                if self.ref[b] == 0:
                    del self._free[b]
                self.ref[b] += 1
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
        for j in self._behind_window(seq):
            self._release(seq.block_table[j])
            seq.block_table[j] = 0
        if self._cow_needed(seq):
            j = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[j], self._pop_free()
            self.ref[src] -= 1
            seq.block_table[j] = dst
            self.pending_copies.append((src, dst))
        seq.block_table.extend(self._pop_free() for _ in range(blocks_for(num_tokens, self.block_size)
                                                                - len(seq.block_table)))

    def count_query(self, seq: Sequence, hits: Seq[int]) -> None:
        """Prefix-cache statistics of an admitted sequence (tokens)."""
        if self.enable_prefix_caching and not seq.skip_prefix_cache:
            self.cache_queries += seq.num_tokens
            self.cache_hits += len(hits) * self.block_size

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """CHILD shares every block of PARENT (same tokens so far); writes into a shared partly filled
        block are copied first."""
        for b in parent.block_table:
            if b:  # not a block released behind the window
                self.ref[b] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free SEQ's blocks past the first NUM_TOKENS tokens (rejected speculative drafts: never cached,
        never shared)."""
        keep = blocks_for(num_tokens, self.block_size)
        for b in reversed(seq.block_table[keep:]):
            if b:  # not a block released behind the window
                self._release(b)
        del seq.block_table[keep:]

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self._free[block] = None
            if self.hash_of[block] is None:  # nothing worth keeping: hand it out before cached ones
                self._free.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            if b:  # not a block released behind the window
                self._release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
