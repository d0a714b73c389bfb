"""LLMEngine: model + KV cache + scheduler + sampler + detokenizer behind add_request / step."""
from __future__ import annotations

import itertools
import logging
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
    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[_Sequence] = []

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from tallow.loader.config import ModelConfig
        from tallow.loader.source import load_weights, resolve_model_source
        from tallow.models import build_model
        from tallow.tokenizer import Tokenizer

        self.args = args
        if args.num_threads:
            tallow.set_num_threads(args.num_threads)
        if args.device != "cpu":
            raise ValueError(f"device {args.device!r} is not supported by this engine build yet (use device='cpu')")
        src = resolve_model_source(m=args.model, w=args.weights_dir, f=args.gguf_file, revision=args.revision)
        if src.kind == "gguf":
            cfg = ModelConfig.from_gguf(src.gguf)
            tok = Tokenizer.from_gguf(src.gguf)
        else:
            cfg = ModelConfig.from_pretrained_dir(src.model_dir)
            tok = Tokenizer.from_pretrained_dir(src.model_dir)
        if args.yarn_scaling_factor:
            cfg = cfg.with_yarn_scaling(args.yarn_scaling_factor)
        if args.chat_template:
            from tallow.tokenizer.chat_template import resolve_chat_template

            tok.chat_template = resolve_chat_template(None, None, args.chat_template)
        self.config, self.tokenizer, self.source = cfg, tok, src
        self.dtype = self._resolve_dtype(args.dtype, cfg, src.kind)
        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else tallow._core.dtype(args.kv_cache_dtype)

        # KV cache: sized from the budget; it must hold at least one max-length sequence.
        bs = args.block_size
        per_block = ModelRunner.kv_bytes_per_block(cfg, bs, kv_dtype)
        budget = (args.mem or DEFAULT_CPU_KV_MB) * 2**20
        num_blocks = args.num_kv_blocks or budget // per_block
        capacity = num_blocks * bs
        max_len = args.max_model_len or cfg.max_position_embeddings
        if args.max_model_len and args.max_model_len > cfg.max_position_embeddings and not args.yarn_scaling_factor:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context "
                             f"({cfg.max_position_embeddings}); use --yarn-scaling-factor to extend it")
        if capacity < max_len:
            if args.max_model_len:
                raise ValueError(
                    f"the KV cache ({args.mem or DEFAULT_CPU_KV_MB} MB = {capacity} tokens at "
                    f"{per_block // bs} bytes/token) cannot hold one sequence of max_model_len={max_len}; "
                    f"raise --mem to at least {-(-max_len * per_block // bs // 2**20)} MB or lower --max-model-len")
            max_len = capacity // bs * bs
            if max_len < bs:
                raise ValueError(f"the KV cache budget ({args.mem} MB) holds less than one block of {bs} tokens "
                                 f"({per_block} bytes); raise --mem")
            log.warning("max_model_len lowered to %d tokens to fit the KV cache (raise --mem for more)", max_len)
        self.max_model_len = max_len

        weights = load_weights(src)
        self.model = build_model(cfg, weights, self.dtype, max_positions=max_len)
        del weights
        self.kv = KVCacheManager(num_blocks, bs, args.prefix_cache, args.prefix_cache_max_tokens)
        self.runner = ModelRunner(self.model, self.kv, num_blocks, bs, kv_dtype, args.device)
        max_batched = args.max_num_batched_tokens or max(8192, args.prefill_chunk_size)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, max_batched, args.prefill_chunk_size), self.kv)
        self.sampler = Sampler(cfg.vocab_size)
        self.eos_ids = set(tok.eos_token_ids) | set(cfg.eos_token_ids)
        self.groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self._ids = itertools.count()
        self.stats = {"schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0, "steps": 0,
                      "prompt_tokens": 0, "generation_tokens": 0}

    @staticmethod
    def _resolve_dtype(name: str, cfg, kind: str):
        if name != "auto":
            return tallow._core.dtype(name)
        # CPU kernels run fastest in f32; half-precision checkpoints are widened once at load.
        return tallow.float32

    # -- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of token ids "
                         "or {'prompt_token_ids': [...]}")

    def _apply_defaults(self, params: SamplingParams) -> SamplingParams:
        a = self.args
        changes = {}
        if a.frequency_penalty is not None and params.frequency_penalty == 0.0:
            changes["frequency_penalty"] = a.frequency_penalty
        if a.presence_penalty is not None and params.presence_penalty == 0.0:
            changes["presence_penalty"] = a.presence_penalty
        if params.seed is None and a.seed is not None:
            changes["seed"] = a.seed
        return params.clone(**changes) if changes else params

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Validate and queue a request; raises ValueError before anything is scheduled."""
        from tallow.tokenizer import IncrementalDetokenizer

        params = self._apply_defaults(params or SamplingParams())
        params.validate()
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is "
                             f"{self.max_model_len}, which must also leave room for at least one generated token")
        if params.max_tokens is None and self.args.max_gen_tokens:
            params = params.clone(max_tokens=self.args.max_gen_tokens)
        request_id = request_id or str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = _Group(request_id, text, ids, params)
        max_stop = max((len(s) for s in params.stop), default=0)
        parent = None
        for i in range(params.n):
            p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if i == 0 else f"{request_id}#{i}"
            req = Request(rid, ids, p, self.max_model_len, parent=parent)
            parent = parent or req
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids, skip_special_tokens=p.skip_special_tokens)
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
        """Run one scheduling step; returns a delta RequestOutput per group that changed."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress: the KV cache cannot hold the waiting request")
            return []
        to_sample = [r for r in out.requests
                     if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        logits = self.runner.execute(out, to_sample)
        t2 = time.perf_counter()
        self.scheduler.after_step(out)
        results = self.sampler.sample(logits, to_sample, self.eos_ids)
        changed: dict[str, _Group] = {}
        for req, res in zip(to_sample, results):
            group, seq = self._seq_of[req.request_id]
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self._append(group, seq, res)
            changed[group.request_id] = group
        t3 = time.perf_counter()
        self.stats["schedule_s"] += t1 - t0
        self.stats["model_s"] += t2 - t1
        self.stats["sample_s"] += t3 - t2
        self.stats["steps"] += 1
        return [self._delta_output(g) for g in changed.values()]

    def _append(self, group: _Group, seq: _Sequence, res) -> None:
        req, p = seq.req, seq.req.params
        token = res.token_id
        req.append_token(token)
        self.stats["generation_tokens"] += 1
        if seq.logprobs is not None:
            entry = {token: Logprob(res.logprob, decoded_token=self.tokenizer.decode([token], False))}
            for rank, (t, lp) in enumerate(res.top_logprobs or [], start=1):
                entry.setdefault(t, Logprob(lp, rank=rank, decoded_token=self.tokenizer.decode([t], False)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += res.logprob
        finish, stop_reason, cut = None, None, False
        can_stop = req.num_output_tokens >= p.min_tokens
        if can_stop and token in p.stop_token_ids:
            finish, stop_reason = "stop", token
        elif can_stop and not p.ignore_eos and token in self.eos_ids:
            finish = "stop"
        else:
            seq.text += seq.detok.add(token)
            if can_stop and p.stop:
                # Search only where a stop string could newly appear.
                start = max(0, seq.sent_text - seq.max_stop_len)
                for s in p.stop:
                    at = seq.text.find(s, start)
                    if at >= 0:
                        seq.text = seq.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                        finish, stop_reason, cut = "stop", s, True
                        break
        if finish is None and p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            finish = "length"
        if finish is None and req.num_tokens >= self.max_model_len:
            finish = "length"
        if finish is not None:
            if not cut:
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
            ids = seq.req.output_token_ids[seq.sent_tokens:]
            lps = seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else None
            seq.sent_text, seq.sent_tokens = upto, len(seq.req.output_token_ids)
            if seq.logprobs is not None:
                seq.sent_logprobs = len(seq.logprobs)
            outs.append(CompletionOutput(seq.index, text, list(ids), seq.cumulative_logprob, lps, seq.finish_reason,
                                         seq.stop_reason))
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished,
                             group.seqs[0].req.num_cached_tokens, delta=True)
