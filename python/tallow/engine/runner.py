"""Model runner: turns a scheduled step into one batched forward pass over the paged KV cache and
returns the logits of the requests that need a next token."""
from __future__ import annotations

import numpy as np

import tallow
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request
from tallow.engine.scheduler import SchedulerOutput
from tallow.layers.attention import AttentionMetadata


class ModelRunner:
    def __init__(self, model, kv: KVCacheManager, num_blocks: int, block_size: int, kv_dtype, device: str = "cpu"):
        cfg = model.cfg
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        shape = [num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim]
        self.kv_caches = [(tallow.empty(shape, kv_dtype, device), tallow.empty(shape, kv_dtype, device))
                          for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, kv_dtype) -> int:
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * kv_dtype.type_size

    def _tensor(self, arr: np.ndarray) -> tallow.Tensor:
        t = tallow.from_numpy(arr)
        return t if self.device == "cpu" else t.to(self.device)

    def execute(self, out: SchedulerOutput, sample_reqs: list[Request]) -> np.ndarray:
        """Run the model on every scheduled token; return float32 logits [len(sample_reqs), vocab]
        for the requests whose sequence the step completes (in sample_reqs order)."""
        bs = self.block_size
        ids, pos, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        last_row: dict[str, int] = {}
        for req in out.requests:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n]
            block_ids = self.kv.block_ids(req)
            p = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(block_ids, dtype=np.int64)
            ids.append(np.asarray(tokens, dtype=np.int32))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            tables.append(block_ids)
            last_row[req.request_id] = qsl[-1] - 1
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            block_tables=self._tensor(bt),
            seq_lens=self._tensor(np.asarray(seq_lens, dtype=np.int32)),
            query_start_loc=self._tensor(np.asarray(qsl, dtype=np.int32)),
            num_tokens=qsl[-1],
        )
        hidden = self.model.forward(self._tensor(np.concatenate(ids)), self._tensor(np.concatenate(pos)),
                                    self.kv_caches, meta)
        if not sample_reqs:
            return np.zeros((0, self.model.cfg.vocab_size), dtype=np.float32)
        rows = self._tensor(np.asarray([last_row[r.request_id] for r in sample_reqs], dtype=np.int64))
        picked = tallow.ops.embedding(rows, hidden)  # gathers the rows that need logits
        logits = self.model.compute_logits(picked)
        if self.device != "cpu":
            logits = logits.to("cpu")
        return np.asarray(logits.to("float32").numpy())
