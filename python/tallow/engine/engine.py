"""LLMEngine: the engine core (core.py: requests, the KV manager, the scheduler, the executor) with
input processing in front and output processing behind, in one process (vLLM v1's seams):

    prompt ─ InputProcessor ─> CoreRequest ─ EngineCore (Scheduler + KVCacheManager + Executor) ─> worker
    RequestOutput <─ OutputProcessor <─ CoreOutputs (stops by token / length) <─ StepOutput <─┘

LLM (offline) and the in-thread AsyncEngine use it; the server's engine-core process runs a bare
EngineCore and keeps the two processors in the API process (engine/core_client.py)."""
from __future__ import annotations

import itertools
import logging
from typing import Optional

import numpy as np

from tallow.engine.args import EngineArgs
from tallow.engine.core import CoreRequest, EngineCore, load_model_source, overlap_depth  # noqa: F401
from tallow.engine.errors import KVCacheFullError
from tallow.engine.input_processor import InputProcessor, PromptType
from tallow.engine.output_processor import OutputProcessor, RequestState
from tallow.engine.outputs import RequestOutput
from tallow.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "PromptType", "KVCacheFullError", "make_request_group"]

log = logging.getLogger("tallow.engine")


def make_request_group(request_id: str, text: Optional[str], ids: list[int], params: SamplingParams,
                       final_only: bool = False) -> tuple[RequestState, CoreRequest, list[tuple[str, SamplingParams]]]:
    """A validated prompt as the output processor's RequestState and the core's CoreRequest: one
    completion per n, each with its own engine request id and parameters (seeds offset by index,
    prompt log-probs only on the first)."""
    rids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
    seqs = []
    for i, rid in enumerate(rids):
        p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i,
                                                      prompt_logprobs=params.prompt_logprobs if i == 0 else None)
        seqs.append((rid, p))
    return RequestState(request_id, text, ids, params, final_only), CoreRequest(request_id, ids, seqs), seqs


class LLMEngine(EngineCore):
    def __init__(self, args: EngineArgs):
        from tallow.tokenizer.byte_level import byte_table

        # Validates the server-wide sampling defaults first (max_model_len is known after the KV plan).
        self.input_processor = InputProcessor(args, None, 0, 0)
        super().__init__(args)
        tok, cfg = self.tokenizer, self.config
        byte_table(tok)  # a byte-level vocabulary's detokenizer table (~0.2 s at 150k tokens): now, not in a request
        ip = self.input_processor
        ip.tokenizer, ip.vocab_size, ip.max_model_len = tok, cfg.vocab_size, self.max_model_len
        ip.use_generation_config(self.source.generation_config_path)
        self.output_processor = OutputProcessor(tok)
        self._ids = itertools.count()

    @property
    def groups(self) -> dict[str, RequestState]:
        return self.output_processor.groups

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, final_only: bool = False) -> str:
        """Validate and queue a request; raises ValueError before anything is scheduled. With
        final_only, step() returns no deltas for it but one RequestOutput holding the whole result
        when it finishes (vLLM's FINAL_ONLY output kind: what offline generate needs, for less host
        work a step)."""
        text, ids, params = self.input_processor.process(prompt, params)
        request_id = request_id or str(next(self._ids))
        group, creq, seqs = make_request_group(request_id, text, ids, params, final_only)
        op = self.output_processor
        if request_id in op.groups or any(r in op.seq_of or self.has_request_id(r) for r, _ in seqs):
            raise ValueError(f"request id {request_id!r} is already in use")
        op.add_request(group, seqs)
        self.add_core_request(creq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.abort(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step (EngineCore.step_core); returns a delta RequestOutput per group
        that changed."""
        core = self.step_core()
        if not core.outputs and not core.prompt_logprobs:
            return []
        outputs, stopped = self.output_processor.process(core.outputs, core.prompt_logprobs)
        if stopped:  # a stop string (found in the text) ended these
            self.finish_stopped(stopped)
        return outputs

    # -- embeddings (the server's /v1/embeddings) ------------------------------------------------
    def embed(self, prompts: list[PromptType], pooling: str = "last", normalize: bool = True
              ) -> list[tuple[np.ndarray, int]]:
        """(pooled vector [hidden_size] float32, number of prompt tokens) per prompt (EngineCore.embed_ids)."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        encoded = self.input_processor.embedding_inputs(prompts)  # every input validated before any runs
        return list(zip(self.embed_ids(encoded, pooling, normalize), (len(ids) for ids in encoded)))
