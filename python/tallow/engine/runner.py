"""Model runner: turns a scheduled step into one batched forward pass over the paged KV cache and
returns the logits of the requests that need a next token.

On a CUDA device every step runs on the runner's own stream; decode-only steps replay a CUDA graph
of their batch-size bucket (cuda_graphs.py) unless graphs are off (enforce_eager), the batch is
bigger than the largest bucket, or the model cannot be captured (it reads device data on the host:
LongRoPE switching, final soft-capping, MoE routing). With TALLOW_DECODE_OVERLAP_MIN set, larger
buckets are captured as two halves on two streams (_forward_halves; opt-in, measured slower)."""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np

import tallow
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request
from tallow.engine.scheduler import SchedulerOutput
from tallow.engine.step_inputs import StepInputs
from tallow.layers.attention import AttentionMetadata

# Mixed steps run the decodes' attention apart from the prefill chunks' (see layers/attention.py);
# TALLOW_SPLIT_MIXED_ATTENTION=0 runs the whole batch through one call.
_SPLIT_MIXED = os.environ.get("TALLOW_SPLIT_MIXED_ATTENTION", "1") != "0"

# With TALLOW_DECODE_OVERLAP_MIN=N (>= 16), captured decode steps of at least N sequences run as two
# halves, each through the whole model on its own stream (see _forward_halves). Off by default: on an
# H100 (Qwen3-0.6B, nano-vllm workload, N = 64) decode steps took 6.95 ms instead of 6.71: the halves'
# attention grids fill every SM, so the other half's small kernels wait for SMs instead of overlapping.
_OVERLAP_MIN_SEQS = int(os.environ.get("TALLOW_DECODE_OVERLAP_MIN", "0"))

log = logging.getLogger("tallow.engine")


class ModelRunner:
    def __init__(self, model, kv: KVCacheManager, block_size: int, kv_dtype, device: str = "cpu", *,
                 max_num_seqs: int = 256, max_num_tokens: int = 8192, max_model_len: int = 4096,
                 kv_scales: tuple[float, float] = (1.0, 1.0), device_sampling: bool = False):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.kv_scales = kv_scales
        # Sampling with the device ops (GpuSampler, on a GPU or for overlapped steps): logits stay tensors
        # and the previous step's sampled ids stay on the device.
        self.device_sampling = device_sampling or device != "cpu"
        self.kv_caches: list = []
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.stream = self.side_stream = None
        if device != "cpu":
            from tallow import cuda

            self.stream = cuda.Stream(tallow.Device(device).index)
            self.side_stream = cuda.Stream(tallow.Device(device).index)  # the second half of split steps
            self.side_stream.set_private_scratch()  # its GEMMs and attention run beside the main stream's
            cuda.set_index_checks(False)  # the runner builds every index itself; checks would sync
        with self.on_stream():
            self.inputs = StepInputs(self.max_num_tokens, max_num_seqs, self.width, device)
            # The previous step's sampled ids, on the device: rows whose token the host does not know
            # yet (overlapped scheduling) read theirs from here (ops.fill_from_previous_).
            self.prev_ids = tallow.empty([max_num_seqs], tallow.int32, device) if self.device_sampling else None
        self.graphs = None
        self.graphs_enabled = False
        self.graph_batch_sizes: list[int] = []
        self.split_graph_sizes: list[int] = []  # buckets captured as two halves (_forward_halves)
        # Captured decode steps may run as two halves (on CUDA). Eager decode steps do too with
        # split_eager_decode (tests: eager steps are bound by the host, which two halves give twice the ops).
        self.split_decode = self.side_stream is not None
        self.split_eager_decode = False
        self.stats = {"graph_steps": 0, "eager_steps": 0}
        self.num_decode_seqs = 0  # of the step being run (see _fill)
        # prompt_logprobs: (request, first position, end position, first row, top) of each request's
        # prompt positions in the step being run (see _fill), and what take_prompt_logprobs hands out
        self._prompt_spans: list[tuple[Request, int, int, int, int]] = []
        self._prompt_lp_out: dict[str, list] = {}

    # -- KV cache ---------------------------------------------------------------------------------
    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, kv_dtype) -> int:
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * kv_dtype.type_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.cfg
        shape = [num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim]
        # On CUDA each block is stored head-major ([blocks, heads, rows, dim] in memory, the ops see the
        # usual [blocks, rows, heads, dim] view with its strides): a kv head's rows of a block are then
        # one contiguous run (4 KiB at 16 rows of 128 bf16) instead of 256-byte pieces 2 KiB apart, which
        # the decode-attention loads stream better (H100, nano-vllm workload: 18.9-19.1k -> 19.1-19.3k
        # tok/s). TALLOW_KV_LAYOUT=nhd keeps the row-major layout.
        head_major = self.device != "cpu" and os.environ.get("TALLOW_KV_LAYOUT", "hnd") != "nhd"

        def cache():
            if head_major:
                t = tallow.empty([shape[0], shape[2], shape[1], shape[3]], self.kv_dtype, self.device)
                return t.permute(0, 2, 1, 3)
            return tallow.empty(shape, self.kv_dtype, self.device)

        with self.on_stream():
            self.kv_caches = [(cache(), cache()) for _ in range(cfg.num_hidden_layers)]

    def on_stream(self):
        """A context in which the runner's stream is the thread's current one (no-op on the CPU)."""
        import contextlib

        if self.stream is None:
            return contextlib.nullcontext()
        from tallow import cuda

        return cuda.stream(self.stream)

    def tensor(self, arr: np.ndarray) -> tallow.Tensor:
        """A host array as a tensor on the model's device."""
        t = tallow.from_numpy(np.ascontiguousarray(arr))
        return t if self.device == "cpu" else t.to(self.device)

    # -- inputs -----------------------------------------------------------------------------------
    def _fill(self, out: SchedulerOutput, sample_reqs: list[Request]) -> tuple[int, int, dict]:
        """Write the step's indices into the host arrays; returns (tokens, sequences, last row of each
        request). Sets self.num_decode_seqs: how many leading sequences have one query (decodes)."""
        inp, bs = self.inputs, self.block_size
        t = 0
        last_row: dict[str, int] = {}
        inp.qsl[0] = 0
        self._prompt_spans = []
        for i, req in enumerate(out.requests):
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            end = min(start + n, req.num_prompt_tokens - 1)  # positions whose next token is in the prompt
            if req.params.prompt_logprobs is not None and end > start:
                self._prompt_spans.append((req, start, end, t, req.params.prompt_logprobs))
            block_ids = self.kv.block_ids(req)
            inp.set_block_row(i, block_ids)
            if n == 1:
                np_ = req.num_prompt_tokens
                inp.ids[t] = req.output_token_ids[start - np_] if start >= np_ else req.prompt_token_ids[start]
                inp.pos[t] = start
                inp.slots[t] = block_ids[start // bs] * bs + start % bs
            else:
                inp.ids[t:t + n] = req.all_token_ids[start:start + n]
                p = np.arange(start, start + n, dtype=np.int64)
                inp.pos[t:t + n] = p
                inp.slots[t:t + n] = inp.bt[i][p // bs].astype(np.int64) * bs + p % bs
            t += n
            inp.seq_lens[i] = start + n
            inp.qsl[i + 1] = t
            last_row[req.request_id] = t - 1
        multi = np.flatnonzero(np.diff(inp.qsl[:len(out.requests) + 1]) != 1)
        nd = (int(multi[0]) if multi.size else len(out.requests)) if _SPLIT_MIXED else 0
        self.num_decode_seqs = nd
        inp.set_decode_prefix(nd, len(out.requests))
        return t, len(out.requests), last_row

    # -- running ----------------------------------------------------------------------------------
    def _forward(self, num_tokens: int, num_seqs: int, num_rows: int, all_rows: bool,
                 num_decode_seqs: int = 0, prompt_spans=()) -> tallow.Tensor:
        ids, pos, meta, rows = self.inputs.views(num_tokens, num_seqs, num_rows, num_decode_seqs)
        if self.prev_ids is not None:
            tallow.ops.fill_from_previous_(ids, self.prev_ids)
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        if prompt_spans:
            self._prompt_logprobs(hidden, prompt_spans)
        if not all_rows:
            hidden = tallow.ops.embedding(rows, hidden)  # the rows that need logits
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, hidden: tallow.Tensor, spans) -> None:
        """Log-probs of the prompt tokens after each span's positions (ops.logprobs over their logits, in
        slices of max_num_seqs rows: no more logits at once than a decode step makes), read back to the
        host (a wait, for these requests only) into _prompt_lp_out."""
        rows = np.concatenate([np.arange(t0, t0 + end - start) for _, start, end, t0, _ in spans])
        targets = np.concatenate([np.asarray(req.prompt_token_ids[start + 1:end + 1], dtype=np.int32)
                                  for req, start, end, _, _ in spans])
        top = max(k for *_, k in spans)
        vals, ids, ranks = [], [], []
        for a in range(0, rows.size, self.max_num_seqs):
            b = min(a + self.max_num_seqs, rows.size)
            logits = self.model.compute_logits(tallow.ops.embedding(self.tensor(rows[a:b].astype(np.int64)), hidden))
            v, i, r = tallow.ops.logprobs(logits, self.tensor(targets[a:b]), top)
            vals.append(np.asarray(v.to("cpu").numpy()))
            ids.append(np.asarray(i.to("cpu").numpy()))
            ranks.append(np.asarray(r.to("cpu").numpy()))
        vals, ids, ranks = np.concatenate(vals), np.concatenate(ids), np.concatenate(ranks)
        at = 0
        for req, start, end, _, k in spans:
            out = self._prompt_lp_out.setdefault(req.request_id, [])
            for j in range(at, at + end - start):
                out.append((start + 1 + j - at, int(targets[j]), float(vals[j, 0]), int(ranks[j]),
                            [(int(ids[j, 1 + c]), float(vals[j, 1 + c])) for c in range(k)]))
            at += end - start

    def take_prompt_logprobs(self) -> dict[str, list]:
        """Prompt log-probs computed since the last call: per request id, (position of the prompt token,
        token, log-prob, rank, [(token, log-prob)] of the top prompt_logprobs) entries."""
        out, self._prompt_lp_out = self._prompt_lp_out, {}
        return out

    def _forward_halves(self, bs: int) -> tallow.Tensor:
        """A decode step of bs sequences as two halves, each through every layer on its own stream
        (this runner's and side_stream), then one lm_head over both. A decode step's attention is
        bound by HBM bandwidth and its GEMMs, norms and RoPE by latency, and a layer's kernels depend
        on each other; two independent halves were meant to let one half's small kernels run while
        the other's attention streams the cache (measured slower: see _OVERLAP_MIN_SEQS). Each
        sequence's result does not depend on the half it is in, but for the kernels the GEMMs pick
        for the halves' row counts. On the CPU the halves run one after the other."""
        from tallow import cuda

        inp, cfg = self.inputs, self.model.cfg
        first = -(-bs // 16) * 8  # about half, a multiple of 8 (GEMM row tiles)
        ids, pos, meta, _ = inp.views(bs, bs)
        if self.prev_ids is not None:
            tallow.ops.fill_from_previous_(ids, self.prev_ids)
        # Allocated before the fork: the side stream writes its rows only after everything queued so far.
        hidden = tallow.empty([bs, cfg.hidden_size], self.model.dtype, self.device)
        if self.side_stream is not None:
            self.side_stream.wait_stream(self.stream)
        for lo, n, stream in ((0, first, self.stream), (first, bs - first, self.side_stream)):
            with cuda.stream(stream):
                half = AttentionMetadata(
                    slot_mapping=meta.slot_mapping.narrow(0, lo, n),
                    block_tables=meta.block_tables.narrow(0, lo, n),
                    seq_lens=meta.seq_lens.narrow(0, lo, n),
                    query_start_loc=meta.query_start_loc.narrow(0, 0, n + 1),  # decode steps: 0, 1, ..., n
                    num_tokens=n)
                h = self.model.forward(ids.narrow(0, lo, n), pos.narrow(0, lo, n), self.kv_caches, half)
                hidden.narrow(0, lo, n).copy_(h)
        if self.side_stream is not None:
            self.stream.wait_stream(self.side_stream)
        return self.model.compute_logits(hidden)

    def _split_decode(self, bs: int) -> bool:
        """Whether a captured decode step of bs sequences runs as two halves (_forward_halves)."""
        return self.split_decode and _OVERLAP_MIN_SEQS > 0 and bs >= max(_OVERLAP_MIN_SEQS, 16)

    def execute(self, out: SchedulerOutput, sample_reqs: list[Request]):
        """Run the model on every scheduled token; return the logits [len(sample_reqs), vocab] of the
        requests whose sequence the step completes, in sample_reqs order: a tensor on the model's device in
        the model dtype (None when none) with device_sampling, else a float32 numpy array ([0, vocab] when none)."""
        logits = self._execute(out, sample_reqs)
        if self.device_sampling:
            return logits
        if logits is None:
            return np.zeros((0, self.model.cfg.vocab_size), dtype=np.float32)
        return np.asarray(logits.to(tallow.float32).numpy())

    def _execute(self, out: SchedulerOutput, sample_reqs: list[Request]) -> Optional[tallow.Tensor]:
        num_tokens, num_seqs, last_row = self._fill(out, sample_reqs)
        inp, spans = self.inputs, self._prompt_spans
        rows = [last_row[r.request_id] for r in sample_reqs]
        decode_only = num_tokens == num_seqs and len(rows) == num_seqs and rows == list(range(num_seqs))
        with self.on_stream():
            bucket = self.graphs.bucket(num_seqs) if (self.graphs_enabled and decode_only and not spans) else None
            if bucket is not None:
                inp.fill_padding(num_seqs, bucket, num_tokens)
                inp.upload(bucket)
                logits = self.graphs.replay(bucket)
                self.stats["graph_steps"] += 1
                return logits.narrow(0, 0, num_seqs) if bucket != num_seqs else logits
            self.stats["eager_steps"] += 1
            if not rows:
                inp.upload(num_seqs)
                ids, pos, meta, _ = inp.views(num_tokens, num_seqs, 0, self.num_decode_seqs)
                if self.prev_ids is not None:
                    tallow.ops.fill_from_previous_(ids, self.prev_ids)
                hidden = self.model.forward(ids, pos, self.kv_caches, meta)
                if spans:
                    self._prompt_logprobs(hidden, spans)
                return None
            inp.rows[:len(rows)] = rows
            inp.upload(num_seqs)
            if decode_only and not spans and self.split_eager_decode and self._split_decode(num_seqs):
                return self._forward_halves(num_seqs)
            return self._forward(num_tokens, num_seqs, len(rows), decode_only, self.num_decode_seqs, spans)

    def keep_sampled(self, ids: tallow.Tensor) -> None:
        """Remember this step's sampled ids [B] on the device for the next step's unknown tokens."""
        if self.prev_ids is not None and ids.shape[0]:
            with self.on_stream():
                self.prev_ids.narrow(0, 0, ids.shape[0]).copy_(ids)

    # -- CUDA graphs ------------------------------------------------------------------------------
    def graph_blockers(self) -> list[str]:
        """Why this model cannot be captured (empty: it can)."""
        m, why = self.model, []
        if any(o is not None for o in getattr(getattr(m, "rope_caches", None), "long_after", [])):
            why.append("LongRoPE switches tables by sequence length on the host")
        if getattr(m.cfg, "final_logit_softcapping", None):
            why.append("final logit soft-capping runs on the host")
        if getattr(m.cfg, "num_experts", 0):
            why.append("MoE routing runs on the host")
        return why

    def capture_graphs(self, max_bs: int) -> None:
        from tallow.engine.cuda_graphs import DecodeGraphs, bucket_sizes

        if self.device == "cpu" or max_bs <= 0:
            return
        why = self.graph_blockers()
        if why:
            log.warning("CUDA graphs off for this model: %s", "; ".join(why))
            return
        sizes = bucket_sizes(min(max_bs, self.max_num_seqs))
        graphs = DecodeGraphs(self.device, self.stream)
        inp = self.inputs

        def prepare(bs: int) -> None:
            inp.fill_padding(0, bs, 0)
            inp.upload(bs)

        try:
            # Decode steps only (qsl is 0, 1, ..., bs: one query per sequence, padding included).
            graphs.capture(sizes, lambda bs: self._forward_halves(bs) if self._split_decode(bs)
                           else self._forward(bs, bs, bs, True), prepare)
            self.split_graph_sizes = [bs for bs in graphs.sizes if self._split_decode(bs)]
        except Exception as e:  # a model doing host work mid-forward: stay eager
            graphs.reset()
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
            return
        self.graphs, self.graphs_enabled, self.graph_batch_sizes = graphs, True, graphs.sizes

    def profile_peak_bytes(self, seq_lens: list[int]) -> int:
        """Peak device memory (bytes above what is allocated now, the scratch KV cache excluded) of one
        eager step prefilling sequences of seq_lens tokens (every sequence's last row sampled), run
        against a scratch KV cache just large enough, which is freed again."""
        from tallow import cuda

        bs, inp = self.block_size, self.inputs
        blocks = [-(-n // bs) for n in seq_lens]
        saved = self.kv_caches
        cuda.synchronize(self.device)
        base = cuda.memory_allocated(self.device)
        cuda.reset_peak_memory_stats(self.device)
        self.allocate_kv_cache(sum(blocks))
        scratch = cuda.memory_allocated(self.device) - base
        t, first = 0, 0
        inp.qsl[0] = 0
        for i, (n, nb) in enumerate(zip(seq_lens, blocks)):
            table = np.arange(first, first + nb, dtype=np.int32)
            inp.bt[i, :nb] = table
            inp.forget_block_rows(i, i + 1)
            p = np.arange(n, dtype=np.int64)
            inp.ids[t:t + n] = 0
            inp.pos[t:t + n] = p
            inp.slots[t:t + n] = table[p // bs].astype(np.int64) * bs + p % bs
            t += n
            first += nb
            inp.seq_lens[i] = n
            inp.qsl[i + 1] = t
        b = len(seq_lens)
        inp.rows[:b] = inp.qsl[1:b + 1] - 1
        try:
            with self.on_stream():
                inp.upload(b)
                self._forward(t, b, b, t == b)
            self.stream.synchronize()
            peak = cuda.max_memory_allocated(self.device) - base - scratch
        finally:
            self.kv_caches = saved
            cuda.empty_cache()
        return max(0, int(peak))

    def profile_lens(self, num_tokens: int, max_model_len: int) -> list[int]:
        """Sequence lengths of the largest prefill step the scheduler can issue."""
        lens, left = [], num_tokens
        while left > 0 and len(lens) < self.max_num_seqs:
            lens.append(min(left, max_model_len))
            left -= lens[-1]
        return lens
