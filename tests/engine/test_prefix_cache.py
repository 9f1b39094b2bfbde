"""Block manager with toy sizes (no model): refcounts, copy-on-write for forked choices, the prefix cache
(hash chain, lookup, LRU eviction, the last token always computed) and the scheduler's use of it."""

from __future__ import annotations

from hotstart.engine.block_manager import BlockManager, block_hash
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.sampling_params import SamplingParams


def seq(rid: str, ids: list[int], n: int = 1) -> Sequence:
    return Sequence(rid, list(ids), len(ids), SamplingParams(max_tokens=100, n=n), forks_pending=n - 1)


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """Allocate for N more tokens and pretend the forward ran."""
    bm.allocate(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def test_hash_chain_depends_on_the_whole_prefix():
    a = block_hash(b"", [1, 2, 3, 4])
    assert a == block_hash(b"", [1, 2, 3, 4]) and a != block_hash(b"", [1, 2, 3, 5])
    assert block_hash(a, [5, 6]) != block_hash(block_hash(b"", [9, 2, 3, 4]), [5, 6])


def test_fork_shares_blocks_and_copies_the_partly_filled_one_on_write():
    bm = BlockManager(8, 4)
    parent = seq("p", list(range(6)), n=3)  # 6 tokens: one full block + 2 tokens in the second
    computed(bm, parent, 6)
    kids = [seq("p", list(range(6))) for _ in range(2)]
    for k in kids:
        bm.fork(parent, k)
    assert bm.num_used == 2 and all(k.block_table == parent.block_table for k in kids)
    assert [bm.ref[b] for b in parent.block_table] == [3, 3]
    for s in (parent, *kids):  # each choice appends its own token at position 6
        s.token_ids.append(7)
    assert bm.blocks_needed(kids[0], 7) == 1  # the copy
    bm.allocate(kids[0], 7)
    bm.allocate(kids[1], 7)
    bm.allocate(parent, 7)  # the last holder writes in place
    full, shared = parent.block_table
    assert kids[0].block_table[0] == kids[1].block_table[0] == full and bm.ref[full] == 3
    tails = {kids[0].block_table[1], kids[1].block_table[1], shared}
    assert len(tails) == 3 and bm.ref[shared] == 1
    assert bm.take_copies() == [(shared, kids[0].block_table[1]), (shared, kids[1].block_table[1])]
    assert bm.take_copies() == []
    for s in (parent, *kids):
        bm.free(s)
    assert bm.num_used == 0 and all(r == 0 for r in bm.ref)


def test_no_copy_when_the_prompt_fills_its_blocks():
    bm = BlockManager(8, 4)
    parent, kid = seq("p", list(range(8)), n=2), seq("p", list(range(8)))
    computed(bm, parent, 8)
    bm.fork(parent, kid)
    for s in (parent, kid):
        s.token_ids.append(1)
        bm.allocate(s, 9)
    assert bm.take_copies() == [] and parent.block_table[:2] == kid.block_table[:2]
    assert parent.block_table[2] != kid.block_table[2] and bm.num_used == 4


def test_prefix_cache_hits_full_blocks_and_always_leaves_the_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq("a", list(range(10)))
    assert bm.lookup(a) == []
    computed(bm, a, 10)
    assert bm.num_cached == 2  # two full blocks; the third holds 2 tokens
    b = seq("b", list(range(9)) + [99, 98])  # shares 9 tokens: two full blocks
    hits = bm.lookup(b)
    assert hits == a.block_table[:2]
    bm.allocate(b, b.num_tokens, hits)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == hits and bm.ref[hits[0]] == 2
    # a prompt that is exactly the cached blocks still computes its last block (its logits are needed)
    c = seq("c", list(range(8)))
    assert bm.lookup(c) == a.block_table[:1]
    # a different first block: nothing after it can hit either (the chain)
    assert bm.lookup(seq("d", [5] + list(range(1, 10)))) == []


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    computed(bm, a, 5)
    cached = list(a.block_table[:2])
    bm.free(a)
    assert bm.num_used == 0 and bm.num_cached == 2  # free, contents and hashes kept
    b = seq("b", [1, 2, 3, 4, 9])
    assert bm.lookup(b) == cached
    assert bm.can_allocate(b, 5, cached)
    bm.allocate(b, 5, cached)
    assert b.num_computed_tokens == 4 and bm.num_used == 3
    bm.free(b)
    # blocks without a hash are handed out first, then cached ones, least recently freed first
    # (a sequence's later blocks before its earlier ones)
    c = seq("c", [7, 7, 7, 7, 7, 7, 7])
    bm.allocate(c, 7)
    assert c.block_table[-1] == cached[0] and c.block_table[-2] == cached[1] and bm.num_cached == 0
    assert bm.lookup(seq("e", [1, 2, 3, 4, 5])) == []


def test_cache_off_computes_everything():
    bm = BlockManager(8, 4)
    a = seq("a", list(range(9)))
    computed(bm, a, 9)
    assert bm.num_cached == 0 and bm.lookup(seq("b", list(range(9)))) == []


def test_scheduler_starts_from_the_cached_prefix_and_counts_it():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a = seq("a", list(range(13)))
    s.add(a)
    assert [(q.request_id, n) for q, n in s.schedule()] == [("a", 13)]
    a.num_computed_tokens += 13
    bm.cache_full_blocks(a)
    s.remove(a)
    b = seq("b", list(range(13)) + [50, 51])
    s.add(b)
    assert [(q.request_id, n) for q, n in s.schedule()] == [("b", 3)]  # 12 cached, 3 to compute
    assert (bm.cache_queries, bm.cache_hits) == (13 + 15, 12)


def test_a_request_of_n_choices_takes_n_slots():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=100)
    big, small = seq("big", [1, 2, 3], n=3), seq("small", [4, 5])
    other = seq("other", [6])
    for q in (small, big, other):
        s.add(q)
    assert [q.request_id for q, _ in s.schedule()] == ["small", "big"]  # 1 + 3 slots: full
    assert list(s.waiting) == [other]
