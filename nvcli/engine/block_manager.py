"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and the prefix cache.

Pure Python (no torch) so it is unit-tested in milliseconds. A block's hash is xxhash64 of
(parent block's hash, the block's token ids); a hit is verified against the stored tokens, so a
hash collision is a miss, never wrong output. Freed blocks keep their hash and sit in an LRU free
list: a later request with the same prefix revives them until they are handed out again.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from nvcli.engine.sequence import BlockTable, Sequence

NO_HASH = -1


def block_hash(token_ids: list[int], parent_hash: int) -> int:
    h = xxhash.xxh64()
    if parent_hash != NO_HASH:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order (oldest first). Values unused: OrderedDict gives O(1) removal.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (full blocks only).

        The last token is never covered, so at least one token is computed and there are
        logits to sample from.
        """
        return self.lookup_prefix(seq)[0]

    def lookup_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
        """find_cached_prefix's hits, and the hash the first full block after them will have once computed (None if
        the prompt has no such block: its last token is never part of one)."""
        if not self.enable_prefix_caching:
            return [], None
        hits: list[int] = []
        parent = NO_HASH
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.block_tokens(i)
            h = block_hash(tokens, parent)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                return hits, h
            hits.append(block_id)
            parent = h
        return hits, None

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        cached = cached or []
        total = self.blocks_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        fresh = total - len(seq.block_table) - len(cached)
        # Cached blocks with no reader sit in the free list: reviving them uses up free blocks.
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return fresh + revived <= len(self.free)

    def take_cached_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Give `seq` (with no blocks yet) the cached blocks; they count as computed. Only a first admission counts in
        the hit rate and in `num_cached_tokens` (as vLLM counts them): a preempted request re-admitted finds its own
        blocks, prompt and output, and would inflate both."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        first = seq.num_preemptions == 0
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        n = len(cached) * self.block_size
        seq.num_computed_tokens = n
        if first:
            seq.num_cached_tokens = n
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody reads (benchmarks: each timed run starts cold).
        Blocks in use keep their hashes. Returns the number of blocks forgotten."""
        return sum(self._forget(block_id) for block_id in self.free)

    def _forget(self, block_id: int) -> bool:
        """Drop the block's cached-prefix identity (its hash and tokens); whether it had one."""
        block = self.blocks[block_id]
        if block.hash == NO_HASH:
            return False
        if self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash = NO_HASH
        block.token_ids = []
        return True

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room in `seq`'s block table for its next `num_new_tokens` tokens."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        need = total - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {need}, free {len(self.free)}")
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            self._forget(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def register_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Hash the blocks that are full and whose KV is computed (the first `num_computed`
        tokens, default all computed ones), so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        num_full = min(num_computed, len(seq.block_table) * self.block_size) // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
            tokens = seq.block_tokens(i)
            h = block_hash(tokens, parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                block.hash = h
                block.token_ids = tokens
                # Keep the first block registered under a hash; a duplicate stays private.
                self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)

    def free_blocks(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody reads go to the free list (MRU end)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash == NO_HASH:
                    # Unhashed blocks hold nothing reusable: hand them out first.
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.free[block_id] = None
        seq.block_table = BlockTable()
        seq.block_hashes = []
        seq.num_computed_tokens = 0
