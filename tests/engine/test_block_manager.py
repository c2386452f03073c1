"""BlockManager: allocation, ref counts, prefix hashes, LRU reuse. No torch, milliseconds."""

from __future__ import annotations

from nvcli.engine.block_manager import BlockManager, block_hash
from nvcli.engine.sequence import Sequence
from nvcli.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), BS)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    cached = bm.find_cached_prefix(s)
    if cached:
        bm.take_cached_prefix(s, cached)
    n = s.num_tokens - s.num_computed_tokens
    assert bm.can_allocate(s, n)
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.register_computed_blocks(s)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    run_prefill(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free_blocks(s)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_is_served_from_cache_and_refcounted() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(12)) + [100, 101])
    run_prefill(bm, a)
    b = seq(list(range(12)) + [200])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:3]
    run_prefill(bm, b)
    assert b.num_cached_tokens == 12 and bm.prefix_hit_tokens == 12
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.free_blocks(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:3])
    bm.free_blocks(b)
    assert bm.num_free_blocks == 16


def test_at_least_one_token_is_recomputed() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    b = seq(list(range(8)))  # identical, block-aligned prompt
    assert len(bm.find_cached_prefix(b)) == 1  # the block holding the last token is not reused


def test_freed_hashed_blocks_are_revived_until_reused() -> None:
    bm = BlockManager(4, BS)
    a = seq(list(range(9)))
    run_prefill(bm, a)
    bm.free_blocks(a)
    b = seq(list(range(8)) + [50])
    assert len(bm.find_cached_prefix(b)) == 2
    run_prefill(bm, b)
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 1
    bm.free_blocks(b)
    # Fill the whole cache with unrelated tokens: the old hashes must be evicted.
    c = seq([900 + i for i in range(16)])
    run_prefill(bm, c)
    bm.free_blocks(c)
    assert bm.find_cached_prefix(seq(list(range(8)) + [50])) == []


def test_lru_evicts_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS)
    a, b = seq([1] * 4 + [2]), seq([3] * 4 + [4])
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free_blocks(a)
    bm.free_blocks(b)
    c = seq([5, 6])  # needs one block: takes an unhashed tail block first, hashed ones survive
    run_prefill(bm, c)
    assert len(bm.find_cached_prefix(seq([1] * 4 + [9]))) == 1
    assert len(bm.find_cached_prefix(seq([3] * 4 + [9]))) == 1
    d = seq([7] * 3)
    run_prefill(bm, d)  # second unhashed block
    e = seq([8] * 3)
    run_prefill(bm, e)  # now a hashed block must go: a's, freed first
    assert bm.find_cached_prefix(seq([1] * 4 + [9])) == []
    assert len(bm.find_cached_prefix(seq([3] * 4 + [9]))) == 1


def test_hash_collision_is_a_miss() -> None:
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    h = block_hash([1, 2, 3, 4], -1)
    bm.blocks[bm.hash_to_block[h]].token_ids = [9, 9, 9, 9]  # simulate a colliding entry
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(list(range(9)))
    run_prefill(bm, a)
    assert bm.find_cached_prefix(seq(list(range(9)))) == []
    assert bm.hash_to_block == {}


def test_can_allocate_counts_revived_blocks() -> None:
    bm = BlockManager(3, BS)
    a = seq(list(range(9)))
    run_prefill(bm, a)  # 3 blocks
    bm.free_blocks(a)
    b = seq(list(range(8)) + [77, 78, 79, 80, 81])  # 2 cached blocks + needs 2 more = 4 > 3
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert not bm.can_allocate(b, b.num_tokens - 8, cached)
    assert bm.can_allocate(b, 4, cached)


def test_reset_prefix_cache_forgets_free_blocks_but_keeps_live_ones() -> None:
    """`nv bench` repeats call this so a timed run cannot reuse the previous run's prompts."""
    bm = BlockManager(16, BS)
    done = seq(list(range(12)) + [1])
    run_prefill(bm, done)
    bm.free_blocks(done)
    live = seq([500 + i for i in range(12)] + [2])
    run_prefill(bm, live)
    assert bm.reset_prefix_cache() == 3
    assert bm.find_cached_prefix(seq(list(range(12)) + [3])) == []
    assert len(bm.find_cached_prefix(seq([500 + i for i in range(12)] + [4]))) == 3  # still in use: kept
    assert bm.num_free_blocks == 16 - len(live.block_table)


def test_a_block_tables_int32_copy_follows_every_change() -> None:
    """Step inputs copy a sequence's block table from its int32 mirror (BlockTable.array), which copies only the ids
    appended since it was last read. Whatever changes the table (appends past the first capacity, a free and a new
    allocation, a prefix-cache hit, a list edit), the mirror must equal the ids, or attention reads another
    sequence's KV."""
    import pickle

    import numpy as np

    from nvcli.engine.sequence import BlockTable

    bm = BlockManager(64, BS)
    s = seq(list(range(6)))
    run_prefill(bm, s)
    assert s.block_table.array().tolist() == list(s.block_table) and s.block_table.array().dtype == np.int32
    for t in range(100):  # decode 100 tokens: 25 more blocks, past the mirror's first 16
        s.token_ids.append(t)
        bm.allocate(s, 1)
        s.num_computed_tokens += 1
        if t % 7 == 0:
            assert s.block_table.array().tolist() == list(s.block_table)
    assert len(s.block_table) == 27 and s.block_table.array().tolist() == list(s.block_table)
    bm.free_blocks(s)  # preemption: the table is replaced, not emptied in place
    assert isinstance(s.block_table, BlockTable) and s.block_table.array().tolist() == []
    run_prefill(bm, s)
    assert s.block_table.array().tolist() == list(s.block_table)
    b = seq(list(range(6)) + list(range(100)))
    run_prefill(bm, b)  # its first blocks come from the prefix cache (take_cached_prefix)
    assert b.num_cached_tokens > 0 and b.block_table.array().tolist() == list(b.block_table)
    edited = BlockTable([5, 6, 7])
    edited.array()
    edited[1] = 9  # not something the engine does; the mirror starts over rather than go stale
    del edited[0]
    edited.insert(0, 4)
    assert edited.array().tolist() == [4, 9, 7]
    copy = pickle.loads(pickle.dumps(edited))
    assert type(copy) is BlockTable and copy.array().tolist() == [4, 9, 7]
