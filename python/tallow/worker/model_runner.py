"""Model runner: turns a step (engine/step_data.py: plain data) into one batched forward pass over
the paged KV cache, samples the requests whose sequence the step completes, and hands back plain
data (sampled ids, log-probs, prompt log-probs).

It keeps its own state per request (CachedRequestState, vLLM's InputBatch in spirit): prompt and
output ids, block ids, sampling parameters and progress, created by a step's NewRequestData, grown
by the blocks later steps add, and dropped when the engine lists the request as finished. The tokens
it samples it appends itself: as -(row + 1) while they are on the device (a later step's input
reads them from prev_ids there: ops.fill_from_previous_), replaced by the value once read back.

On a CUDA device every step runs on the runner's own stream; decode-only steps replay a CUDA graph
of their batch-size bucket (cuda_graphs.py) unless graphs are off (enforce_eager), the batch is
bigger than the largest bucket, or the model cannot be captured (it reads device data on the host:
LongRoPE switching, final soft-capping, MoE routing)."""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

import tallow
from tallow.engine.sampling_params import SamplingParams
from tallow.engine.step_data import EmbedData, StepData, StepOutput
from tallow.layers.attention import AttentionMetadata
from tallow.parallel.communicator import get_tp_group, wait_event
from tallow.worker.sampler import Sampler
from tallow.worker.step_inputs import StepInputs

log = logging.getLogger("tallow.worker")


class CachedRequestState:
    """The worker's copy of one request (the names match the engine's Request: the sampler reads it)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "block_ids",
                 "num_computed_tokens", "num_prompt_tokens")

    def __init__(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                 params: SamplingParams, block_ids: list[int], num_computed_tokens: int):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = list(output_token_ids)
        self.params = params
        self.block_ids = list(block_ids)
        self.num_computed_tokens = num_computed_tokens
        self.num_prompt_tokens = len(prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


class LaunchedStep:
    """A step whose sampling is queued on the device; result() reads its tokens back (waiting for
    that copy only), writes them into the request states and returns the StepOutput."""

    __slots__ = ("states", "slots", "sample", "prompt_lp", "timing")

    def __init__(self, states, slots, sample, prompt_lp, timing=None):
        self.states, self.slots, self.sample, self.prompt_lp, self.timing = states, slots, sample, prompt_lp, timing

    def result(self) -> StepOutput:
        tokens, lps = self.sample.read() if self.sample is not None else ([], None)
        for st, slot, t in zip(self.states, self.slots, tokens):
            st.output_token_ids[slot] = t
        gpu_s = None
        if self.timing is not None:
            self.timing[1].synchronize()
            gpu_s = self.timing[0].elapsed_time(self.timing[1]) / 1e3
        return StepOutput([st.request_id for st in self.states], tokens, lps, self.prompt_lp, gpu_s)


class _ReceivedIds:
    """A tensor-parallel rank > 0's sampled ids: rank 0's, received by broadcast. On a GPU the broadcast
    runs on the runner's stream, so read() waits for its event first (through the tensor-parallel group:
    a rank 0 that died raises instead of hanging); a copy on the default stream would not wait for it."""

    __slots__ = ("ids", "event")

    def __init__(self, ids: tallow.Tensor, event=None):
        self.ids, self.event = ids, event

    def read(self) -> tuple[list[int], None]:
        if self.event is not None:
            wait_event(self.event)
        return np.asarray(self.ids.to("cpu").numpy()).tolist(), None


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: its share, or one (replicated) when ranks outnumber them."""
    return num_kv_heads // tp_size if num_kv_heads >= tp_size else 1


def kv_cache_spec(cfg, tp_size: int = 1) -> tuple[int, int, int, bool]:
    """(kv heads on one rank, k dim, v dim, v is a view of k's first v-dim values) of a layer's cache: the
    family's own when its model class says (DeepSeek's latent cache: kv_cache_spec), else per-head K and V."""
    from tallow.models import registry

    own = getattr(registry.model_class(cfg.family), "kv_cache_spec", None)
    if own is not None:
        return own(cfg, tp_size)
    return local_kv_heads(cfg.num_key_value_heads, tp_size), cfg.head_dim, cfg.head_dim, False


class ModelRunner:
    def __init__(self, model, block_size: int, kv_dtype, device: str = "cpu", *,
                 max_num_seqs: int = 256, max_num_tokens: int = 8192, max_model_len: int = 4096,
                 eos_ids=(), overlap_depth: int = 1, step_timing: bool = False):
        self.model = model
        # Tensor parallelism: every rank runs the forward pass; rank 0 samples and broadcasts the ids.
        self.tp_rank, self.tp_size = getattr(model, "tp_rank", 0), getattr(model, "tp_size", 1)
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.vocab_size = model.cfg.vocab_size
        self.eos_ids = set(eos_ids)
        self.kv_caches: list = []
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.stream = None
        self.step_timing = step_timing and device != "cpu"
        if device != "cpu":
            from tallow import cuda

            self.stream = cuda.Stream(tallow.Device(device).index)
            cuda.set_index_checks(False)  # the runner builds every index itself; checks would sync
        with self.on_stream():
            self.inputs = StepInputs(self.max_num_tokens, max_num_seqs, self.width, device)
            # The previous step's sampled ids, on the device: rows whose token the host does not know
            # yet (overlapped steps) read theirs from here (ops.fill_from_previous_).
            self.prev_ids = tallow.empty([max_num_seqs], tallow.int32, device)
        self.sampler = Sampler(self.vocab_size, overlap_depth=overlap_depth)
        self.requests: dict[str, CachedRequestState] = {}
        self.graphs = None
        self.graphs_enabled = False
        self.graph_batch_sizes: list[int] = []
        self.stats = {"graph_steps": 0, "eager_steps": 0}
        self.num_decode_seqs = 0  # of the step being run (see _fill)
        # prompt_logprobs: (state, first position, end position, first row, top) of each request's
        # prompt positions in the step being run (see _fill)
        self._prompt_spans: list = []

    # -- KV cache ---------------------------------------------------------------------------------
    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, kv_dtype, tp_size: int = 1) -> int:
        heads, k_dim, v_dim, v_in_k = kv_cache_spec(cfg, tp_size)
        return cfg.num_hidden_layers * block_size * heads * (k_dim + (0 if v_in_k else v_dim)) * kv_dtype.type_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.cfg
        heads, k_dim, v_dim, v_in_k = kv_cache_spec(cfg, self.tp_size)
        shape = [num_blocks, self.block_size, heads, k_dim]
        # On CUDA each block is stored head-major ([blocks, heads, rows, dim] in memory, the ops see the
        # usual [blocks, rows, heads, dim] view with its strides): a kv head's rows of a block are then
        # one contiguous run (4 KiB at 16 rows of 128 bf16) instead of 256-byte pieces 2 KiB apart, which
        # the decode-attention loads stream better (H100, nano-vllm workload: 18.9-19.1k -> 19.1-19.3k
        # tok/s; the row-major alternative was retired, see benchmarks/results/README.md).
        head_major = self.device != "cpu"

        def cache(dim):
            if head_major:
                t = tallow.empty([shape[0], shape[2], shape[1], dim], self.kv_dtype, self.device)
                return t.permute(0, 2, 1, 3)
            return tallow.empty(shape[:3] + [dim], self.kv_dtype, self.device)

        def layer():
            k = cache(k_dim)
            return (k, k.narrow(3, 0, v_dim)) if v_in_k else (k, cache(v_dim))

        with self.on_stream():
            self.kv_caches = [layer() for _ in range(cfg.num_hidden_layers)]

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

    # -- request states ---------------------------------------------------------------------------
    def update_states(self, step: StepData) -> None:
        """Drop the finished requests, add the new ones, append the new block ids."""
        reqs = self.requests
        if step.finished_req_ids:
            self.drop_requests(step.finished_req_ids)
        for nr in step.new_reqs:  # (a preempted request's stale state is replaced; its seed is kept)
            reqs[nr.req_id] = CachedRequestState(nr.req_id, nr.prompt_token_ids, nr.output_token_ids, nr.params,
                                                 nr.block_ids, nr.num_computed_tokens)
        for rid, ids in step.new_block_ids.items():
            reqs[rid].block_ids.extend(ids)

    def drop_requests(self, req_ids) -> None:
        """Forget finished requests: their state here and the sampler's."""
        reqs, sampler = self.requests, self.sampler
        for rid in req_ids:
            reqs.pop(rid, None)
            sampler.forget(rid)

    # -- inputs -----------------------------------------------------------------------------------
    def _fill(self, step: StepData) -> tuple[int, int, list, list]:
        """Write the step's indices into the host arrays; returns (tokens, sequences, rows to sample,
        their request states). Advances each state's num_computed_tokens. Sets self.num_decode_seqs:
        how many leading sequences have one query (decodes)."""
        inp, bs, reqs = self.inputs, self.block_size, self.requests
        t = 0
        rows: list[int] = []
        sample: list[CachedRequestState] = []
        qsl, seq_lens, ids, pos, slots = inp.qsl, inp.seq_lens, inp.ids, inp.pos, inp.slots
        qsl[0] = 0
        spans = self._prompt_spans = []
        nd = -1
        for i, (rid, n) in enumerate(zip(step.req_ids, step.num_scheduled_tokens)):
            st = reqs[rid]
            start = st.num_computed_tokens
            np_ = st.num_prompt_tokens
            block_ids = st.block_ids
            inp.set_block_row(i, block_ids)
            if start < np_ - 1 and st.params.prompt_logprobs is not None:
                end = min(start + n, np_ - 1)  # positions whose next token is in the prompt
                spans.append((st, start, end, t, st.params.prompt_logprobs))
            if n == 1:
                ids[t] = st.output_token_ids[start - np_] if start >= np_ else st.prompt_token_ids[start]
                pos[t] = start
                slots[t] = block_ids[start // bs] * bs + start % bs
            else:
                if nd < 0:
                    nd = i
                if start + n <= np_:
                    ids[t:t + n] = st.prompt_token_ids[start:start + n]
                else:
                    ids[t:t + n] = (st.prompt_token_ids + st.output_token_ids)[start:start + n]
                p = np.arange(start, start + n, dtype=np.int64)
                pos[t:t + n] = p
                slots[t:t + n] = inp.bt[i][p // bs].astype(np.int64) * bs + p % bs
            t += n
            st.num_computed_tokens = start + n
            seq_lens[i] = start + n
            qsl[i + 1] = t
            if start + n >= st.num_tokens:
                rows.append(t - 1)
                sample.append(st)
        num_seqs = len(step.req_ids)
        if nd < 0:
            nd = num_seqs
        # Mixed steps run the decodes' attention apart from the prefill chunks' (layers/attention.py):
        # the decodes are the leading one-token sequences (the scheduler puts them first).
        self.num_decode_seqs = nd
        inp.set_decode_prefix(nd, num_seqs)
        return t, num_seqs, rows, sample

    # -- running ----------------------------------------------------------------------------------
    def _forward(self, num_tokens: int, num_seqs: int, num_rows: int, all_rows: bool,
                 num_decode_seqs: int = 0, prompt_spans=()) -> tuple[Optional[tallow.Tensor], Optional[dict]]:
        ids, pos, meta, rows = self.inputs.views(num_tokens, num_seqs, num_rows, num_decode_seqs)
        tallow.ops.fill_from_previous_(ids, self.prev_ids)
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        prompt_lp = self._prompt_logprobs(hidden, prompt_spans) if prompt_spans else None
        if num_rows == 0:
            return None, prompt_lp
        if not all_rows:
            hidden = tallow.ops.embedding(rows, hidden)  # the rows that need logits
        return self.model.compute_logits(hidden), prompt_lp

    def _prompt_logprobs(self, hidden: tallow.Tensor, spans) -> dict[str, list]:
        """Log-probs of the prompt tokens after each span's positions (ops.logprobs over their logits, in
        slices of max_num_seqs rows: no more logits at once than a decode step makes), read back to the
        host (a wait, for these requests only)."""
        rows = np.concatenate([np.arange(t0, t0 + end - start) for _, start, end, t0, _ in spans])
        targets = np.concatenate([np.asarray(st.prompt_token_ids[start + 1:end + 1], dtype=np.int32)
                                  for st, start, end, _, _ in spans])
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
        out: dict[str, list] = {}
        at = 0
        for st, start, end, _, k in spans:
            entries = out.setdefault(st.request_id, [])
            for j in range(at, at + end - start):
                entries.append((start + 1 + j - at, int(targets[j]), float(vals[j, 0]), int(ranks[j]),
                                [(int(ids[j, 1 + c]), float(vals[j, 1 + c])) for c in range(k)]))
            at += end - start
        return out

    def forward_step(self, step: StepData):
        """Run the model on every scheduled token. Returns (logits [len(states), vocab] on the device in
        the model dtype, or None when no request samples; the request states that sample, in row order;
        prompt log-probs {request id: entries} or None). Tests wrap this to see the logits."""
        num_tokens, num_seqs, rows, states = self._fill(step)
        inp, spans = self.inputs, self._prompt_spans
        if len(rows) != step.num_sampled:
            raise RuntimeError(f"the worker's request states disagree with the engine's: {len(rows)} requests "
                               f"complete their sequence this step, the engine expects {step.num_sampled}")
        decode_only = num_tokens == num_seqs and len(rows) == num_seqs
        bucket = self.graphs.bucket(num_seqs) if (self.graphs_enabled and decode_only and not spans) else None
        if bucket is not None:
            inp.fill_padding(num_seqs, bucket, num_tokens)
            inp.upload(bucket)
            logits = self.graphs.replay(bucket)
            self.stats["graph_steps"] += 1
            return (logits.narrow(0, 0, num_seqs) if bucket != num_seqs else logits), states, None
        self.stats["eager_steps"] += 1
        inp.rows[:len(rows)] = rows
        inp.upload(num_seqs)
        logits, prompt_lp = self._forward(num_tokens, num_seqs, len(rows), decode_only, self.num_decode_seqs, spans)
        return logits, states, prompt_lp

    def execute_model(self, step: StepData, mask_fn=None) -> LaunchedStep:
        """Queue one step (model and sampling) on the device; the LaunchedStep reads it back.
        mask_fn (structured output): called after the forward pass is queued, so the host computes
        the grammar masks while the device runs it; returns [rows, words] int32 or None."""
        with self.on_stream():
            self.update_states(step)
            timing = self._timing_events()
            logits, states, prompt_lp = self.forward_step(step)
            launched = None
            if states and self.tp_rank > 0:  # rank 0 samples; its ids are the next step's inputs here too
                ids = get_tp_group().broadcast(tallow.empty([len(states)], tallow.int32, self.device), src=0)
                launched = _ReceivedIds(ids, self._recorded_event())
                self.prev_ids.narrow(0, 0, ids.shape[0]).copy_(ids)
            elif states:
                bitmask = mask_fn() if mask_fn is not None else None
                launched = self.sampler.launch(logits, states, self.eos_ids, bitmask)
                ids = launched.ids
                if self.tp_size > 1:
                    get_tp_group().broadcast(ids, src=0)
                self.prev_ids.narrow(0, 0, ids.shape[0]).copy_(ids)
            if timing is not None:
                timing[1].record()
        slots = []
        for row, st in enumerate(states):
            out = st.output_token_ids
            out.append(-(row + 1))
            slots.append(len(out) - 1)
        return LaunchedStep(states, slots, launched, prompt_lp or {}, timing)

    def _recorded_event(self):
        """On a GPU, an event recorded on the current stream (the runner's, inside on_stream); None on the CPU."""
        if self.device == "cpu":
            return None
        from tallow import cuda

        ev = cuda.Event()
        ev.record()
        return ev

    def _timing_events(self):
        """With step timing on a GPU: a started (start, end) CUDA event pair around the step's work."""
        if not self.step_timing:
            return None
        from tallow import cuda

        ev = (cuda.Event(True), cuda.Event(True))
        ev[0].record()
        return ev

    # -- embeddings -------------------------------------------------------------------------------
    def embed(self, data: EmbedData) -> np.ndarray:
        """One chunk of an embedding input (EmbedData), computed into the given blocks (the caller
        frees them): the final hidden state (after the model's final norm) of the chunk's last token,
        or for mean pooling the float64 sum of its tokens' states, [hidden_size]."""
        bs, n, start = self.block_size, len(data.token_ids), data.start
        table = np.asarray(data.block_ids, dtype=np.int64)
        pos = np.arange(start, start + n, dtype=np.int64)
        with self.on_stream():
            meta = AttentionMetadata(
                slot_mapping=self.tensor(table[pos // bs] * bs + pos % bs),
                block_tables=self.tensor(table.astype(np.int32)[None, :]),
                seq_lens=self.tensor(np.asarray([start + n], dtype=np.int32)),
                query_start_loc=self.tensor(np.asarray([0, n], dtype=np.int32)),
                num_tokens=n)
            hidden = self.model.forward(self.tensor(np.asarray(data.token_ids, dtype=np.int32)), self.tensor(pos),
                                        self.kv_caches, meta)
            h = np.asarray(hidden.to(tallow.float32).to("cpu").numpy(), dtype=np.float32)
        return h[-1].copy() if data.pooling == "last" else h.sum(axis=0, dtype=np.float64)

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
        from tallow.worker.cuda_graphs import DecodeGraphs, bucket_sizes

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
            graphs.capture(sizes, lambda bs: self._forward(bs, bs, bs, True)[0], prepare)
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
