"""Input processing: a prompt (text, token ids or a prompt dict) and its sampling parameters become
validated token ids and the parameters the engine runs with (server-wide defaults applied). It runs
before anything is queued, so a bad request raises ValueError and changes nothing (vLLM v1's
InputProcessor; with an engine core in its own process this part stays in the API process)."""
from __future__ import annotations

import logging
from typing import Optional, Union

import numpy as np

from tallow.engine.args import EngineArgs
from tallow.engine.sampling_params import SamplingParams

PromptType = Union[str, dict, list[int]]
# EngineArgs fields that are server-wide sampling defaults (`tallow serve --temperature ...`)
SERVER_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty")
log = logging.getLogger("tallow.engine")


class InputProcessor:
    def __init__(self, args: EngineArgs, tokenizer, vocab_size: int, max_model_len: int):
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._seed_rng = np.random.default_rng(args.seed)
        self.model_defaults: dict = {}  # sampling defaults from the model's generation_config.json
        try:  # server-wide sampling defaults must be valid request values
            SamplingParams(max_tokens=args.max_gen_tokens, **self.server_defaults())
        except (ValueError, TypeError) as e:
            raise ValueError(str(e).replace("invalid sampling parameter", "invalid engine argument (sampling default)")
                             .replace("max_tokens", "max_gen_tokens")) from None

    def server_defaults(self) -> dict:
        """{field: value} of the server-wide sampling defaults that are set (EngineArgs)."""
        return {name: getattr(self.args, name) for name in SERVER_DEFAULTS if getattr(self.args, name) is not None}

    # -- prompts ---------------------------------------------------------------------------------
    def prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, token ids) of a prompt; ValueError for a malformed one."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
                return self.prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of token ids "
                         "or {'prompt_token_ids': [...]}")

    def use_generation_config(self, path: Optional[str]) -> dict:
        """Take the sampling defaults of the model's generation_config.json at path (None: the model has
        none), unless --generation-config vllm; logs what was taken, once. Returns them."""
        from tallow.loader.generation_config import sampling_defaults

        self.model_defaults = sampling_defaults(path) if self.args.generation_config == "auto" else {}
        if self.model_defaults:
            log.info("sampling defaults from %s: %s (a request's own values win; --generation-config vllm "
                     "ignores them)", path, ", ".join(f"{k}={v}" for k, v in self.model_defaults.items()))
        return self.model_defaults

    def apply_defaults(self, params: SamplingParams) -> SamplingParams:
        """Defaults fill what the request left unset, in this order: server-wide ones (EngineArgs), then
        the model's generation_config.json; a value the request sets, even 0, wins. A default seed
        seeds a generator of per-request seeds: a run is reproducible, yet two unseeded requests do
        not sample the same stream."""
        a = self.args
        unset = params.unset_fields
        changes = {name: value for name, value in self.server_defaults().items() if name in unset}
        for name, value in self.model_defaults.items():
            if name in unset and name not in changes:
                changes[name] = value
        if params.seed is None and a.seed is not None:
            changes["seed"] = int(self._seed_rng.integers(2**62))
        return params.clone(**changes) if changes else params

    # -- requests --------------------------------------------------------------------------------
    def process(self, prompt: PromptType, params: Optional[SamplingParams]
                ) -> tuple[Optional[str], list[int], SamplingParams]:
        """(prompt text, prompt ids, sampling parameters with defaults) of a request; ValueError when
        the prompt or parameters are invalid for this model."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        text, ids = self.prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
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
        return text, ids, self.apply_defaults(params)

    def embedding_inputs(self, prompts) -> list[list[int]]:
        """Token ids of each embedding input (one prompt or a list of them), every one validated
        before any runs."""
        if isinstance(prompts, (str, dict)) or (prompts and all(is_int(t) for t in prompts)):
            prompts = [prompts]
        encoded = []
        for prompt in prompts:
            _, ids = self.prompt_ids(prompt)
            if not ids:
                raise ValueError("the input is empty")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is out of range: this model's vocabulary has ids "
                                 f"0..{self.vocab_size - 1}")
            if len(ids) > self.max_model_len:
                raise ValueError(f"the input has {len(ids)} tokens; this model's context (max_model_len) is "
                                 f"{self.max_model_len}")
            encoded.append(ids)
        return encoded


def is_int(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)


def token_ids(ids) -> list[int]:
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError("'prompt_token_ids' must be a list of integer token ids")
    if set(map(type, ids)) <= {int}:  # the common case, checked at C speed (bool is not int here)
        return list(ids)
    if not all(is_int(t) for t in ids):
        raise ValueError("'prompt_token_ids' must be a list of integer token ids")
    return [int(t) for t in ids]
