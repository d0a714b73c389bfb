"""Per-request block tables over the BlockPool, with prefix-cache lookups (vLLM v1's shape)."""
from __future__ import annotations

from typing import Optional

from tallow.engine.block_pool import NONE_HASH, BlockPool, KVBlock, hash_block
from tallow.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_max_tokens: Optional[int] = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        max_cached = None if prefix_cache_max_tokens is None else max(0, prefix_cache_max_tokens // block_size)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, max_cached)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids (read by the runner every step)
        self._num_cached_blocks: dict[str, int] = {}  # blocks of the request registered in the cache

    # -- hashing ---------------------------------------------------------------------------------
    def _update_block_hashes(self, req: Request) -> None:
        # Slices of the prompt and output lists (not req.all_token_ids: overlapped steps call this
        # with a block's last token still unknown, once per step until it is, at every block).
        bs, hashes = self.block_size, req.block_hashes
        prompt, out = req.prompt_token_ids, req.output_token_ids
        n_prompt = len(prompt)
        while (len(hashes) + 1) * bs <= n_prompt + len(out):
            lo = len(hashes) * bs
            hi = lo + bs
            if (prompt[hi - 1] if hi <= n_prompt else out[hi - 1 - n_prompt]) < 0:
                break  # a sampled token the host does not know yet (overlapped steps): later
            if hi <= n_prompt:
                block = prompt[lo:hi]
            elif lo >= n_prompt:
                block = out[lo - n_prompt:hi - n_prompt]
            else:
                block = prompt[lo:] + out[:hi - n_prompt]
            hashes.append(hash_block(hashes[-1] if hashes else NONE_HASH, block))

    # -- scheduling API --------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of whole blocks, leaving at least one token to compute (its
        logits are needed). Live blocks of other requests count too (n > 1 siblings share them).
        A request asking for prompt log-probs computes its whole prompt (none are cached)."""
        if req.params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None or (block.ref_cnt == 0 and not self.enable_prefix_caching):
                break
            hits.append(block)
        self.pool.queries += max_blocks
        self.pool.hits += len(hits)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] = ()) -> bool:
        """Make room for num_new_tokens more tokens after req.num_computed_tokens (which already
        counts new_computed_blocks). False, changing nothing, when the pool is too small."""
        blocks = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens + num_new_tokens
        if not new_computed_blocks and total <= len(blocks) * self.block_size and \
                total // self.block_size <= self._num_cached_blocks.get(req.request_id, 0):
            return True  # most decode steps: room in the last block, every full block registered

        needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        reused_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) + reused_free > self.pool.num_free_blocks:
            return False
        self.pool.touch(new_computed_blocks)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        ids = self.req_block_ids.setdefault(req.request_id, [])
        blocks.extend(new_computed_blocks)
        ids.extend(b.block_id for b in new_computed_blocks)
        if needed > 0:
            new = self.pool.get_new_blocks(needed)
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
        # Blocks whose tokens are all known and will hold KV after this step become shareable.
        self._update_block_hashes(req)
        n_full = min(total // self.block_size, len(req.block_hashes))
        start = self._num_cached_blocks.get(req.request_id, 0)
        for i in range(start, n_full):
            self.pool.cache_full_block(blocks[i], req.block_hashes[i])
        self._num_cached_blocks[req.request_id] = max(start, n_full)
        return True

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self.req_block_ids.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def block_ids(self, req: Request) -> list[int]:
        """The request's block ids in order (the manager's own list: do not modify)."""
        return self.req_block_ids.get(req.request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.hits / self.pool.queries if self.pool.queries else 0.0
