"""KV-cache blocks: a pool with free queues and a prefix cache keyed by chained block hashes.

A full block's hash covers its tokens and, through its parent's hash, every token before it,
so equal hashes mean equal prefixes. Free blocks without a hash are handed out first (FIFO);
free blocks that still hold cached KV are kept in LRU order and are reused (evicted) last.
"""
from __future__ import annotations

import collections
from typing import Iterable, Optional

NONE_HASH = 0  # parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids: Iterable[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, max_cached_free_blocks: Optional[int] = None):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_cached_free_blocks = max_cached_free_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: collections.deque[int] = collections.deque(range(num_blocks))
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._cached: dict[int, KVBlock] = {}  # hash -> block (in use or free)
        # statistics for the prefix-cache hit rate
        self.queries = 0
        self.hits = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> Optional[KVBlock]:
        return self._cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be handed out."""
        return list(self._free_uncached) + list(self._free_cached)

    # -- allocation ------------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} KV blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free_uncached:
                block = self.blocks[self._free_uncached.popleft()]
            else:
                block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently used
                block = self.blocks[block_id]
                self._drop_hash(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order (callers pass a sequence's blocks tail
        first, so its tail is evicted before its head)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt > 0:
                continue
            if self.enable_caching and block.block_hash is not None:
                self._free_cached[block.block_id] = None
            else:
                self._drop_hash(block)
                self._free_uncached.append(block.block_id)
        self._trim_cached()

    def cache_full_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a full block's contents for reuse (live sharing always; reuse after free only
        with caching enabled). A hash already registered to another block is left alone."""
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._drop_hash(self.blocks[block_id])
            self._free_uncached.append(block_id)

    # -- internals -------------------------------------------------------------------------------
    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def _trim_cached(self) -> None:
        limit = self.max_cached_free_blocks
        if limit is None:
            return
        while len(self._free_cached) > limit:
            block_id, _ = self._free_cached.popitem(last=False)
            self._drop_hash(self.blocks[block_id])
            self._free_uncached.append(block_id)
