"""LLMEngine: model + KV cache + scheduler + sampler + detokenizer behind add_request / step."""
from __future__ import annotations

import collections
import gc
import itertools
import logging
import os
import time
from typing import Optional, Union

import numpy as np

import tallow
from tallow.engine.args import EngineArgs
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tallow.engine.request import Request, RequestStatus
from tallow.engine.runner import ModelRunner
from tallow.engine.sampler import Sampler
from tallow.engine.sampling_params import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("tallow.engine")
_STEP_TIMING = os.environ.get("TALLOW_STEP_TIMING", "") not in ("", "0")
# Decode steps batch their sequences longest context first (TALLOW_DECODE_ORDER=fcfs keeps the
# scheduler's order): the decode-attention grid then starts the longest CTAs first, so short ones fill
# the tail instead of one long CTA running alone at the end (longest-processing-time-first).
_LONGEST_FIRST = os.environ.get("TALLOW_DECODE_ORDER", "length") != "fcfs"
# Once the engine is built (on a GPU), everything alive then (modules, the model, the tokenizer's
# ~550k tables entries at a 152k vocabulary) moves to the collector's permanent generation, and the
# youngest generation is collected every 50,000 allocations instead of 700, so full collections,
# which stop the host while the GPU drains its queue, become rare and scan only what came later.
# In the nano-vllm workload (H100, `python benchmarks/nano_steps.py --gaps`) the run's three full
# collections took 20-33 ms each, 9-13 ms with the freeze alone, and none ran with both. An engine
# built later unfreezes first, so what an earlier one froze can still be collected.
# TALLOW_GC_FREEZE=0 leaves the collector alone.
_GC_FREEZE = os.environ.get("TALLOW_GC_FREEZE", "1") != "0"


def _overlap_depth() -> int:
    """Overlapped steps: how many launched steps may be unread when step() returns
    (TALLOW_OVERLAP_DEPTH, default 2), read per engine. With two the host has a whole GPU step of
    slack: on some H100 machines the nano-vllm workload's GPU sat idle 0.05-0.13 s of a 7.5 s run
    between steps with one, after host pauses of 5-20 ms; on a quiet one both measured the same.
    Outputs then come two steps after their tokens were sampled."""
    raw = os.environ.get("TALLOW_OVERLAP_DEPTH", "")
    try:
        return max(1, int(raw or 2))
    except ValueError:
        log.warning("TALLOW_OVERLAP_DEPTH=%r is not a whole number; using 2", raw)
        return 2


def _order_decode_batch(out) -> None:
    """Sort a decode-only step's requests by context length, longest first (see _LONGEST_FIRST)."""
    if _LONGEST_FIRST and len(out.requests) > 1 and all(
            out.num_scheduled_tokens[r.request_id] == 1 for r in out.requests):
        out.requests.sort(key=lambda r: -r.num_tokens)

PromptType = Union[str, dict, list[int]]
DEFAULT_CPU_KV_MB = 2048


class _Sequence:
    """Output state of one completion (one Request) of a request group."""

    def __init__(self, index: int, req: Request, detok, max_stop_len: int):
        self.index = index
        self.req = req
        self.detok = detok
        self.text = ""
        self.sent_text = 0  # characters already returned in deltas
        self.sent_tokens = 0
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if req.params.logprobs is not None else None
        self.sent_logprobs = 0
        self.cumulative_logprob = 0.0 if req.params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.max_stop_len = max_stop_len


class _Group:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 final_only: bool = False):
        self.request_id = request_id
        self.final_only = final_only  # step() returns this group's output once, when it finishes
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[_Sequence] = []
        # prompt_logprobs: entries by prompt position as they arrive (chunks), then the whole list
        self.prompt_lp: Optional[dict[int, dict[int, Logprob]]] = {} if params.prompt_logprobs is not None else None
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def has_output(self) -> bool:
        return not self.final_only or self.finished


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from tallow.loader.config import ModelConfig
        from tallow.loader.source import resolve_model_source
        from tallow.models import load_model
        from tallow.tokenizer import Tokenizer
        from tallow.tokenizer.byte_level import byte_table

        self.args = args
        try:  # server-wide sampling defaults must be valid request values
            SamplingParams(frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                           max_tokens=args.max_gen_tokens)
        except ValueError as e:
            raise ValueError(str(e).replace("invalid sampling parameter", "invalid engine argument (sampling default)")
                             .replace("max_tokens", "max_gen_tokens")) from None
        if args.num_threads:
            tallow.set_num_threads(args.num_threads)
        self.device = self._check_device(args.device)
        dummy = args.load_format == "dummy"
        src = resolve_model_source(m=args.model, w=args.weights_dir, f=args.gguf_file, revision=args.revision,
                                   config_only=dummy)
        if src.kind == "gguf":
            cfg = ModelConfig.from_gguf(src.gguf)
            tok = Tokenizer.from_gguf(src.gguf)
        else:
            cfg = ModelConfig.from_pretrained_dir(src.model_dir)
            if dummy and not (src.tokenizer_path or src.tokenizer_model_path):
                from tallow.loader.dummy import placeholder_tokenizer

                tok = placeholder_tokenizer(cfg)  # benchmarks on a bare config.json: token i is "t<i>"
            else:
                tok = Tokenizer.from_pretrained_dir(src.model_dir)
        if args.yarn_scaling_factor:
            cfg = cfg.with_yarn_scaling(args.yarn_scaling_factor)
        if args.chat_template:
            from tallow.tokenizer.chat_template import resolve_chat_template

            tok.chat_template = resolve_chat_template(None, None, args.chat_template)
        self.config, self.tokenizer, self.source = cfg, tok, src
        byte_table(tok)  # a byte-level vocabulary's detokenizer table (~0.2 s at 150k tokens): now, not in a request
        self.dtype = self._resolve_dtype(args.dtype, cfg, src.kind)
        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else tallow._core.dtype(args.kv_cache_dtype)

        # Weights: each checkpoint tensor goes from the mmap to the model's device as it is, and the model
        # is built there (fusing, casting, dequantizing); dummy weights (load_format="dummy": random
        # values of the checkpoint's shapes) are made on the device.
        model_positions = max(args.max_model_len or 0, cfg.max_position_embeddings)
        self.model = load_model(cfg, src, self.dtype, self.device, load_format=args.load_format, seed=args.seed or 0,
                                max_positions=model_positions)

        bs = args.block_size
        if args.max_model_len and args.max_model_len > cfg.max_position_embeddings and not args.yarn_scaling_factor:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context "
                             f"({cfg.max_position_embeddings}); use --yarn-scaling-factor to extend it")
        max_len = args.max_model_len or cfg.max_position_embeddings
        max_batched = args.max_num_batched_tokens or max(8192, args.prefill_chunk_size)
        self.overlap = args.async_scheduling if args.async_scheduling is not None else self.device != "cpu"
        self.runner = ModelRunner(self.model, None, bs, kv_dtype, self.device, max_num_seqs=args.max_num_seqs,
                                  max_num_tokens=max_batched, max_model_len=max_len,
                                  device_sampling=self.overlap or self.device != "cpu")

        # KV cache: sized from the budget (--mem MB; on a GPU by default gpu_memory_fraction of the
        # memory free after the weights, less the peak of the largest step and the decode graphs'
        # memory); it must hold at least one max-length sequence.
        per_block = ModelRunner.kv_bytes_per_block(cfg, bs, kv_dtype)
        graph_bs = 0 if (self.device == "cpu" or args.enforce_eager) else min(
            args.cuda_graph_max_bs if args.cuda_graph_max_bs is not None else args.max_num_seqs, args.max_num_seqs)
        if args.mem:
            budget = args.mem * 2**20
        elif self.device != "cpu":
            budget = self._gpu_kv_budget(args, max_batched, min(max_len, max_batched), graph_bs)
        else:
            budget = DEFAULT_CPU_KV_MB * 2**20
        num_blocks = args.num_kv_blocks or budget // per_block
        capacity = num_blocks * bs
        if capacity < max_len:
            if args.max_model_len:
                raise ValueError(
                    f"the KV cache ({budget // 2**20} MB = {capacity} tokens at "
                    f"{per_block // bs} bytes/token) cannot hold one sequence of max_model_len={max_len}; "
                    f"raise --mem to at least {-(-max_len * per_block // bs // 2**20)} MB or lower --max-model-len")
            max_len = capacity // bs * bs
            if max_len < bs:
                raise ValueError(f"the KV cache budget ({budget // 2**20} MB) holds less than one block of {bs} "
                                 f"tokens ({per_block} bytes); raise --mem")
            log.warning("max_model_len lowered to %d tokens to fit the KV cache (raise --mem for more)", max_len)
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, bs, args.prefix_cache, args.prefix_cache_max_tokens)
        self.runner.kv = self.kv
        self.runner.allocate_kv_cache(num_blocks)
        if graph_bs:
            self.runner.capture_graphs(graph_bs)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, max_batched, args.prefill_chunk_size), self.kv)
        self._overlap_depth = _overlap_depth() if self.overlap else 1
        if not self.runner.device_sampling:
            self.sampler = Sampler(cfg.vocab_size)
        else:
            from tallow.engine.gpu_sampler import GpuSampler

            self.sampler = GpuSampler(cfg.vocab_size, overlap_depth=self._overlap_depth)
        self.eos_ids = set(tok.eos_token_ids) | set(cfg.eos_token_ids)
        self.groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(args.seed)
        # GPU: launched steps whose tokens are not read yet, oldest first (at most the overlap depth between steps)
        self._pending: collections.deque[_PendingStep] = collections.deque()
        self.stats = {"schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0, "steps": 0,
                      "prompt_tokens": 0, "generation_tokens": 0}
        if _GC_FREEZE and self.device != "cpu":
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            young, middle, old = gc.get_threshold()
            gc.set_threshold(max(young, 50_000), middle, old)

    def _gpu_kv_budget(self, args: EngineArgs, max_batched: int, profile_len: int, graph_bs: int) -> int:
        """Bytes for the KV cache on a GPU: gpu_memory_fraction of the memory free now (weights loaded),
        less the peak of the largest prefill step and of the decode graphs (profiled, not guessed)."""
        from tallow import cuda

        free, _total = cuda.mem_get_info(self.device)
        step_peak = self.runner.profile_peak_bytes(self.runner.profile_lens(max_batched, profile_len))
        graph_peak = self.runner.profile_peak_bytes([1] * graph_bs) if graph_bs else 0
        budget = int(free * args.gpu_memory_fraction) - step_peak - graph_peak
        log.info("GPU memory: %.2f GiB free after weights; step peak %.2f GiB, decode graphs %.2f GiB; "
                 "KV cache %.2f GiB", free / 2**30, step_peak / 2**30, graph_peak / 2**30, budget / 2**30)
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {free / 2**30:.2f} GiB free after the weights, "
                             f"a {max_batched}-token step needs {step_peak / 2**30:.2f} GiB; lower "
                             "--max-num-batched-tokens or raise --gpu-memory-fraction")
        return budget

    @staticmethod
    def _check_device(device: str) -> str:
        d = str(tallow.Device(device))  # ValueError for a malformed name
        if d == "cpu":
            return d
        if not tallow._core.build_info.get("cuda"):
            raise ValueError(f"device {device!r}: this build of tallow has no CUDA backend (reinstall on a machine "
                             "with nvcc, or use device='cpu')")
        from tallow import cuda

        if not cuda.is_available() or tallow.Device(d).index >= cuda.device_count():
            raise ValueError(f"device {device!r}: no such CUDA device (visible: {cuda.device_count()})")
        return d

    def _resolve_dtype(self, name: str, cfg, kind: str):
        if name != "auto":
            return tallow._core.dtype(name)
        if self.device != "cpu":  # GPUs: the checkpoint's half type, bf16 for f32/GGUF checkpoints
            return tallow.float16 if cfg.dtype == "float16" else tallow.bfloat16
        # CPU kernels run fastest in f32; half-precision checkpoints are widened once at load.
        return tallow.float32

    # -- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of token ids "
                         "or {'prompt_token_ids': [...]}")

    def _apply_defaults(self, params: SamplingParams) -> SamplingParams:
        """Server-wide defaults (EngineArgs) fill what the request left unset; a value the request
        sets, even 0, wins. A default seed seeds a generator of per-request seeds: a run is
        reproducible, yet two unseeded requests do not sample the same stream."""
        a = self.args
        changes = {}
        unset = params.unset_fields
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(a, name) is not None and name in unset:
                changes[name] = getattr(a, name)
        if params.seed is None and a.seed is not None:
            changes["seed"] = int(self._seed_rng.integers(2**62))
        return params.clone(**changes) if changes else params

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, final_only: bool = False) -> str:
        """Validate and queue a request; raises ValueError before anything is scheduled. With
        final_only, step() returns no deltas for it but one RequestOutput holding the whole result
        when it finishes (vLLM's FINAL_ONLY output kind: what offline generate needs, for less host
        work a step)."""
        from tallow.tokenizer import detokenizer_for

        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # (C speed; the loop only names the culprit)
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad} is out of range: this model's vocabulary has ids 0..{vocab - 1}")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is out of range: this model's vocabulary has ids "
                             f"0..{vocab - 1}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is "
                             f"{self.max_model_len}, which must also leave room for at least one generated token")
        if params.max_tokens is None and self.args.max_gen_tokens:
            params = params.clone(max_tokens=self.args.max_gen_tokens)
        request_id = request_id or str(next(self._ids))
        rids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        if request_id in self.groups or any(r in self._seq_of or r in self.scheduler.requests for r in rids):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self._apply_defaults(params)
        group = _Group(request_id, text, ids, params, final_only)
        if group.prompt_lp is not None and len(ids) == 1:
            group.prompt_logprobs = [None]
        max_stop = max((len(s) for s in params.stop), default=0)
        parent = None
        for i in range(params.n):
            p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i,
                                                          prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            rid = rids[i]
            req = Request(rid, ids, p, self.max_model_len, parent=parent)
            parent = parent or req
            detok = detokenizer_for(self.tokenizer, prompt_ids=ids, skip_special_tokens=p.skip_special_tokens)
            seq = _Sequence(i, req, detok, max_stop)
            group.seqs.append(seq)
            self._seq_of[rid] = (group, seq)
        self.groups[request_id] = group
        for seq in group.seqs:
            self.scheduler.add_request(seq.req)
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            self.scheduler.finish_request(seq.req, RequestStatus.FINISHED_ABORTED)
            self.sampler.forget(seq.req.request_id)
            self._seq_of.pop(seq.req.request_id, None)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns a delta RequestOutput per group that changed.

        With overlap (async_scheduling, the default on a GPU), steps overlap with the host: step n is
        launched before the tokens of steps n-1 (and n-2: TALLOW_OVERLAP_DEPTH, default 2) are read
        back, and the outputs returned are the oldest unread step's. A request whose newest tokens are
        still on the device holds -(row + 1) for each in its output ids; the runner fills the newest
        in on the device. Penalised requests need their full history on the host, so a step after one
        sampling them waits (see _must_read_first)."""
        with self.runner.on_stream():  # every op of the step (model, sampling, copies) on one stream
            if not self.overlap:
                return self._step_sync()
            return self._step_overlapped()

    def _step_overlapped(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._pending and self._must_read_first():
            return self._finish(self._pending.popleft())
        out = self.scheduler.schedule()
        _order_decode_batch(out)
        t1 = time.perf_counter()
        if out.is_empty:
            if self._pending:
                return self._finish(self._pending.popleft())
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress: the KV cache cannot hold the waiting request")
            return []
        to_sample = [r for r in out.requests
                     if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        timing = self._timing_events()
        logits = self.runner.execute(out, to_sample)
        self._take_prompt_logprobs()
        self.scheduler.after_step(out)
        launched = self.sampler.launch(logits, to_sample, self.eos_ids) if to_sample else None
        if timing is not None:
            timing[1].record()
        if launched is not None:
            self.runner.keep_sampled(launched.ids)
        slots = []
        for row, req in enumerate(to_sample):
            req.append_token(-(row + 1))
            slots.append(req.num_output_tokens - 1)
            p = req.params
            if (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens) or \
                    req.num_tokens >= self.max_model_len:
                req.awaiting_final = True
        needs_history = any(_penalised(r.params) for r in to_sample)
        self._pending.append(_PendingStep(to_sample, slots, launched, needs_history, timing))
        t2 = time.perf_counter()
        self.stats["schedule_s"] += t1 - t0
        self.stats["model_s"] += t2 - t1
        self.stats["steps"] += 1
        if len(self._pending) > self._overlap_depth:
            return self._finish(self._pending.popleft())
        return []

    def _must_read_first(self) -> bool:
        """Whether the oldest launched step's tokens must reach the host before the next step is
        scheduled. Penalised requests need their whole history there. And an unknown token is filled
        in on the device from the newest sampling step only (runner.prev_ids), so a live request that
        an older launched step sampled but the newest did not (preempted, or left out for the token
        budget) waits until that older step is read."""
        pending = self._pending
        if any(p.needs_history for p in pending):
            return True
        if len(pending) < 2:
            return False
        newest = pending[-1].req_set
        return any(r not in newest and not r.is_finished and not r.awaiting_final
                   for i in range(len(pending) - 1) for r in pending[i].reqs)

    def _timing_events(self):
        """With TALLOW_STEP_TIMING=1 on a GPU: a started (start, end) event pair; stats["gpu_s"] then sums
        the GPU time of the steps (to compare with the host's time per step)."""
        if self.device == "cpu" or not _STEP_TIMING:
            return None
        from tallow import cuda

        ev = (cuda.Event(True), cuda.Event(True))
        ev[0].record()
        return ev

    def _finish(self, pending: "_PendingStep") -> list[RequestOutput]:
        """Read a launched step's sampled tokens (waiting for the GPU if needed) and apply them."""
        t0 = time.perf_counter()
        results = pending.launched.results() if pending.launched is not None else []
        if pending.timing is not None:
            pending.timing[1].synchronize()
            self.stats["gpu_s"] = self.stats.get("gpu_s", 0.0) + pending.timing[0].elapsed_time(pending.timing[1]) / 1e3
        changed: dict[str, _Group] = {}
        for req, slot, res in zip(pending.reqs, pending.slots, results):
            entry = self._seq_of.get(req.request_id)
            if entry is None or req.is_finished:  # aborted or finished meanwhile: the token is dropped
                continue
            group, seq = entry
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            req.output_token_ids[slot] = res.token_id
            self._append(group, seq, res, slot + 1)
            changed[group.request_id] = group
        self.stats["sample_s"] += time.perf_counter() - t0
        return [self._delta_output(g) for g in changed.values() if g.has_output]

    def _step_sync(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        _order_decode_batch(out)
        t1 = time.perf_counter()
        if out.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress: the KV cache cannot hold the waiting request")
            return []
        to_sample = [r for r in out.requests
                     if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        logits = self.runner.execute(out, to_sample)
        self._take_prompt_logprobs()
        t2 = time.perf_counter()
        self.scheduler.after_step(out)
        results = self.sampler.sample(logits, to_sample, self.eos_ids) if to_sample else []
        changed: dict[str, _Group] = {}
        for req, res in zip(to_sample, results):
            group, seq = self._seq_of[req.request_id]
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            req.append_token(res.token_id)
            self._append(group, seq, res, req.num_output_tokens)
            changed[group.request_id] = group
        t3 = time.perf_counter()
        self.stats["schedule_s"] += t1 - t0
        self.stats["model_s"] += t2 - t1
        self.stats["sample_s"] += t3 - t2
        self.stats["steps"] += 1
        return [self._delta_output(g) for g in changed.values() if g.has_output]

    def _take_prompt_logprobs(self) -> None:
        """File the step's prompt log-probs (runner.take_prompt_logprobs) under their groups; a group's
        list is complete once every prompt position after the first has its entry."""
        for rid, entries in self.runner.take_prompt_logprobs().items():
            found = self._seq_of.get(rid)
            if found is None or found[0].prompt_lp is None:
                continue
            group = found[0]
            decode = self.tokenizer.decode
            for pos, token, lp, rank, top in entries:  # pos: the position of `token` in the prompt
                entry = {token: Logprob(lp, rank=rank, decoded_token=decode([token], False))}
                for r, (t, v) in enumerate(top, start=1):
                    entry.setdefault(t, Logprob(v, rank=r, decoded_token=decode([t], False)))
                group.prompt_lp[pos] = entry
            n = len(group.prompt_ids)
            if group.prompt_logprobs is None and len(group.prompt_lp) == n - 1:
                group.prompt_logprobs = [None] + [group.prompt_lp[i] for i in range(1, n)]

    def _append(self, group: _Group, seq: _Sequence, res, num_out: int) -> None:
        """Apply sampled token res (already stored as output token num_out - 1): logprobs, stop checks,
        detokenisation. Output ids after num_out (a token still on the device) are dropped on finish."""
        req, p = seq.req, seq.req.params
        token = res.token_id
        self.stats["generation_tokens"] += 1
        if seq.logprobs is not None:
            entry = {token: Logprob(res.logprob, rank=res.rank, decoded_token=self.tokenizer.decode([token], False))}
            for rank, (t, lp) in enumerate(res.top_logprobs or [], start=1):
                entry.setdefault(t, Logprob(lp, rank=rank, decoded_token=self.tokenizer.decode([t], False)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += res.logprob
        finish, stop_reason, cut = None, None, False
        can_stop = num_out >= p.min_tokens
        if can_stop and token in p.stop_token_ids:
            finish, stop_reason = "stop", token
            if p.include_stop_str_in_output and p.detokenize:
                seq.text += seq.detok.add(token)
        elif can_stop and not p.ignore_eos and token in self.eos_ids:
            finish = "stop"
        elif not p.detokenize:
            pass
        else:
            before = len(seq.text)
            new = seq.detok.add(token)
            seq.text += new
            if can_stop and p.stop and new:
                # Only where a stop string could newly end: it must take in some of the new text.
                # Held-back deltas (see _delta_output) guarantee nothing from here on was sent.
                start = max(0, before - seq.max_stop_len + 1)
                found = [(at, s) for s in p.stop if (at := seq.text.find(s, start)) >= 0]
                if found:
                    at, s = min(found, key=lambda f: (f[0], -len(f[1])))  # the earliest one
                    seq.text = seq.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                    finish, stop_reason, cut = "stop", s, True
        if finish is None and p.max_tokens is not None and num_out >= p.max_tokens:
            finish = "length"
        if finish is None and req.num_prompt_tokens + num_out >= self.max_model_len:
            finish = "length"
        if finish is not None:
            del req.output_token_ids[num_out:]
            if not cut and p.detokenize:
                seq.text += seq.detok.finish()
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED if finish == "stop"
                                          else RequestStatus.FINISHED_LENGTH)
            self.sampler.forget(req.request_id)
            self._seq_of.pop(req.request_id, None)

    def _delta_output(self, group: _Group) -> RequestOutput:
        outs = []
        for seq in group.seqs:
            # Hold back text that could still become the start of a stop string.
            hold = 0 if seq.finish_reason is not None else max(seq.max_stop_len - 1, 0)
            upto = max(seq.sent_text, len(seq.text) - hold)
            text = seq.text[seq.sent_text:upto]
            out_ids = seq.req.output_token_ids
            known = len(out_ids)
            while known and out_ids[known - 1] < 0:  # tokens still on the device (at most the overlap depth)
                known -= 1
            ids = out_ids[seq.sent_tokens:known]
            lps = seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else None
            seq.sent_text, seq.sent_tokens = upto, known
            if seq.logprobs is not None:
                seq.sent_logprobs = len(seq.logprobs)
            outs.append(CompletionOutput(seq.index, text, list(ids), seq.cumulative_logprob, lps, seq.finish_reason,
                                         seq.stop_reason))
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished,
                             group.seqs[0].req.num_cached_tokens, delta=True, prompt_logprobs=group.prompt_logprobs)

    # -- embeddings (the server's /v1/embeddings) ------------------------------------------------
    def embed(self, prompts: list[PromptType], pooling: str = "last", normalize: bool = True
              ) -> list[tuple[np.ndarray, int]]:
        """Pooled final hidden states (after the model's final norm) of each prompt, without
        sampling: "last" is the last token's, "mean" the average over all prompt tokens; L2-normalised
        when normalize. Returns (float32 vector [hidden_size], number of prompt tokens) per prompt.
        Each prompt runs as one forward pass over freshly taken KV blocks that go back to the pool
        at once (they do not join the prefix cache). Call it between steps (AsyncEngine does)."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        if isinstance(prompts, (str, dict)) or (prompts and all(_is_int(t) for t in prompts)):
            prompts = [prompts]
        encoded = []
        for prompt in prompts:  # validate every input before running any
            _, ids = self._prompt_ids(prompt)
            if not ids:
                raise ValueError("the input is empty")
            bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is out of range: this model's vocabulary has ids "
                                 f"0..{self.config.vocab_size - 1}")
            if len(ids) > self.max_model_len:
                raise ValueError(f"the input has {len(ids)} tokens; this model's context (max_model_len) is "
                                 f"{self.max_model_len}")
            encoded.append(ids)
        return [(self._pooled_hidden(ids, pooling, normalize), len(ids)) for ids in encoded]

    def _pooled_hidden(self, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
        from tallow.layers.attention import AttentionMetadata

        bs, n, pool, r = self.kv.block_size, len(ids), self.kv.pool, self.runner
        num_blocks = -(-n // bs)
        if num_blocks > pool.num_free_blocks:
            raise KVCacheFullError(f"the KV cache has no room for a {n}-token input right now "
                                   f"({pool.num_free_blocks} of {pool.num_blocks} blocks free); retry later")
        blocks = pool.get_new_blocks(num_blocks)
        try:
            table = np.asarray([b.block_id for b in blocks], dtype=np.int64)
            pos = np.arange(n, dtype=np.int64)
            with r.on_stream():
                meta = AttentionMetadata(
                    slot_mapping=r.tensor(table[pos // bs] * bs + pos % bs),
                    block_tables=r.tensor(table.astype(np.int32)[None, :]),
                    seq_lens=r.tensor(np.asarray([n], dtype=np.int32)),
                    query_start_loc=r.tensor(np.asarray([0, n], dtype=np.int32)),
                    num_tokens=n)
                hidden = self.model.forward(r.tensor(np.asarray(ids, dtype=np.int32)), r.tensor(pos), r.kv_caches,
                                            meta)
                h = np.asarray(hidden.to(tallow.float32).to("cpu").numpy(), dtype=np.float32)
        finally:
            pool.free_blocks(reversed(blocks))
        vec = h[-1] if pooling == "last" else h.mean(axis=0)
        if normalize:
            norm = float(np.linalg.norm(vec))
            if norm > 0:
                vec = vec / norm
        return np.ascontiguousarray(vec, dtype=np.float32)


class _PendingStep:
    """A launched step whose sampled tokens have not been read back yet."""

    __slots__ = ("reqs", "slots", "launched", "needs_history", "timing", "_req_set")

    def __init__(self, reqs, slots, launched, needs_history: bool, timing=None):
        self.reqs, self.slots, self.launched, self.needs_history = reqs, slots, launched, needs_history
        self.timing = timing  # (start, end) CUDA events around the step's GPU work, when measured
        self._req_set = None

    @property
    def req_set(self) -> frozenset:
        if self._req_set is None:
            self._req_set = frozenset(self.reqs)
        return self._req_set


def _penalised(p: SamplingParams) -> bool:
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


class KVCacheFullError(RuntimeError):
    """The KV cache cannot take this work right now (a server answers 503: retry later)."""


def _is_int(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)


def _token_ids(ids) -> list[int]:
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError("'prompt_token_ids' must be a list of integer token ids")
    if set(map(type, ids)) <= {int}:  # the common case, checked at C speed (bool is not int here)
        return list(ids)
    if not all(_is_int(t) for t in ids):
        raise ValueError("'prompt_token_ids' must be a list of integer token ids")
    return [int(t) for t in ids]
