"""`from tallow import LLM, SamplingParams`: offline batched generation, shaped like vLLM's LLM."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from tallow.engine.args import EngineArgs
from tallow.engine.embedding_output import EmbeddingOutput, EmbeddingRequestOutput
from tallow.engine.engine import LLMEngine, PromptType
from tallow.engine.outputs import RequestOutput
from tallow.engine.sampling_params import SamplingParams

# use_tqdm=: True (a tqdm bar on stderr, as vLLM's default), False, or a callable making the bar
# (e.g. functools.partial(tqdm, leave=False)); it is called with total=, desc=, unit= and dynamic_ncols=.
TqdmArg = Union[bool, Callable[..., Any]]


def _progress_bar(use_tqdm: TqdmArg, total: int, desc: str, unit: str):
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)


class LLM:
    """LLM(model="org/name" | "path/to/dir" | "model.gguf", dtype=..., device=..., **engine_args).
    Engine arguments are those of `tallow serve` (see EngineArgs); quantization="q4k" (--isq) quantizes
    an unquantized checkpoint's weights to that GGUF type while they load (q4_0 ... q8_0, q2k ... q6k)."""

    def __init__(self, model: Optional[str] = None, **engine_args):
        if model is not None and str(model).endswith(".gguf") and "gguf_file" not in engine_args:
            engine_args["gguf_file"] = model
            model = None
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- generation ------------------------------------------------------------------------------
    def _normalise(self, prompts) -> list[PromptType]:
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [list(prompts)]  # one prompt of token ids
            return list(prompts)
        return [prompts]  # a string, a dict, or something the engine rejects with a clear message

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: TqdmArg = True) -> list[RequestOutput]:
        """Generate for one or many prompts, batched; one RequestOutput per prompt, in order.
        use_tqdm: a progress bar of finished prompts with the input and output token rates (vLLM's)."""
        prompts = self._normalise(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling params must be a SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for p, sp in zip(prompts, params):  # only finished outputs come back (whole)
                ids.append(self.engine.add_request(p, sp, final_only=True))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(ids), "Processed prompts", "prompt")
        t0, toks_in, toks_out = time.monotonic(), 0, 0
        try:
            for out in self._run(set(ids)):  # one each, whole: final_only requests
                out.delta = False
                final[out.request_id] = out
                if bar is not None:
                    toks_in += len(out.prompt_token_ids)
                    toks_out += out.completion_tokens
                    dt = max(time.monotonic() - t0, 1e-9)
                    bar.set_postfix_str(f"est. speed input: {toks_in / dt:.2f} toks/s, "
                                        f"output: {toks_out / dt:.2f} toks/s", refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], use_tqdm: TqdmArg = True,
              pooling: str = "last", normalize: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order, as vLLM's LLM.embed: outputs.embedding is the final hidden
        state (after the model's norm) of the last token ("last") or the mean over the tokens ("mean"),
        L2-normalised unless normalize=False. Every prompt is validated before any runs."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        encoded = self.engine.input_processor.embedding_inputs(self._normalise(prompts))
        bar = _progress_bar(use_tqdm, len(encoded), "Embedded prompts", "prompt")
        results = []
        try:
            for ids in encoded:  # one at a time: the engine computes an input in prefill-sized chunks anyway
                (vector,) = self.engine.embed_ids([ids], pooling, normalize)
                results.append(EmbeddingRequestOutput(str(len(results)), EmbeddingOutput(vector.tolist()), ids))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results

    def _run(self, ids: set[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in ids:
                        yield out
                        if out.finished:
                            pending.discard(out.request_id)
        finally:
            for rid in pending:  # interrupted (exception or closed generator): free the blocks
                self.engine.abort_request(rid)

    def generate_stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
                        ) -> Iterator[RequestOutput]:
        """Yield delta RequestOutputs (new text and tokens per completion) as they are produced."""
        rid = self.engine.add_request(prompt, sampling_params)
        yield from self._run({rid})

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, tools=None,
             add_generation_prompt: bool = True, chat_template: Optional[str] = None,
             chat_template_kwargs: Optional[dict] = None, use_tqdm: TqdmArg = True,
             **template_kwargs) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several.
        chat_template_kwargs (vLLM's name; e.g. {"enable_thinking": False}) and any other keyword
        arguments are passed to the template."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, tools=tools, add_generation_prompt=add_generation_prompt,
                                                                tokenize=True, chat_template=chat_template,
                                                                **kwargs)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

