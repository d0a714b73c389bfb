"""Structured output: validity and speed (issue 28's targets).

1. Validity: --num outputs (default 200) under 8 JSON schemas at temperature 1 with fresh seeds; each
   must finish and validate (jsonschema). Prints how many did.
2. Speed: --batch requests (default 64) decoding --tokens tokens each, unconstrained (ignore_eos)
   against the same requests under a JSON schema that cannot complete within the budget (an array
   of at least 1,000 objects), so both runs generate the same number of tokens; output tok/s of each,
   best of --repeats, alternating, and their ratio; with each run's engine steps, ms per step and the
   host milliseconds per step spent filling grammar masks and advancing matchers.

    python benchmarks/structured_output.py --model PATH.gguf [--device cuda] [--json out.json]
    python benchmarks/structured_output.py --shape llama3-8b --device cuda   # random weights, real shapes

--shape llama3-8b: Llama-3-8B's config with load_format="dummy" and benchmarks/gpu_e2e.py's byte-level
tokenizer of 128,256 tokens (masks over a real vocabulary's width; the step time of a real 8B model).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python")
# the validity test's schemas and prompts; gpu_e2e's model folders
sys.path[:0] = [os.path.join(_TESTS, "engine"), _TESTS, os.path.dirname(os.path.abspath(__file__))]

LONG_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "qty"], "additionalProperties": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--shape", choices=["llama3-8b"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compact", action="store_true",
                    help="JSON without whitespace between tokens (tiny models otherwise fill the budget with blanks)")
    a = ap.parse_args()

    import jsonschema

    from tallow import LLM, SamplingParams
    from tallow.engine.structured_output import StructuredOutputsParams as SO
    from test_structured_output import JSON_BUDGET, PROMPTS, SCHEMAS

    kw = {"device": a.device} if a.device else {}
    model = a.model
    if a.shape:
        import tempfile

        import gpu_e2e

        model = gpu_e2e.write_model_dir(tempfile.mkdtemp(), a.shape, gpu_e2e.LLAMA3_8B, tokenizer=True)
        kw.update(load_format="dummy", dtype="bfloat16")
    llm = LLM(model, max_num_seqs=max(64, a.batch), **kw)
    core = llm.engine  # LLMEngine is the EngineCore

    def schema(s: dict) -> dict:
        return {**s, "x-guidance": {"whitespace_flexible": False}} if a.compact else s

    params = [SamplingParams(temperature=1.0, max_tokens=JSON_BUDGET, seed=secrets.randbits(32),
                             structured_outputs=SO(json=schema(SCHEMAS[k % len(SCHEMAS)]))) for k in range(a.num)]
    t0 = time.perf_counter()
    outs = llm.generate([PROMPTS[k % len(PROMPTS)] for k in range(a.num)], params, use_tqdm=False)
    valid_s = time.perf_counter() - t0
    valid = 0
    for k, out in enumerate(outs):
        o = out.outputs[0]
        try:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMAS[k % len(SCHEMAS)])
                valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    print(f"validity: {valid}/{a.num} outputs finished and validate ({valid_s:.1f} s)")

    prompts = [f"Write a list of {a.tokens} items as JSON, item {i}:" for i in range(a.batch)]
    free = SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True)
    constrained = free.clone(structured_outputs=SO(json=schema(LONG_SCHEMA)))
    llm.generate(prompts[:4], [free] * 2 + [constrained] * 2, use_tqdm=False)  # warm-up (graphs, tokenizer)
    best = {"unconstrained": 0.0, "json_schema": 0.0}
    steps: dict = {}
    for _ in range(a.repeats):
        for name, p in (("unconstrained", free), ("json_schema", constrained)):
            g = core.grammars
            before = (core.stats["steps"], g.mask_s, g.consume_s)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n == a.batch * a.tokens, f"{name}: {n} tokens, expected {a.batch * a.tokens}"
            k = core.stats["steps"] - before[0]
            row = {"steps": k, "ms_per_step": 1e3 * dt / k, "mask_ms_per_step": 1e3 * (g.mask_s - before[1]) / k,
                   "consume_ms_per_step": 1e3 * (g.consume_s - before[2]) / k}
            print(f"  {name:13s} {n / dt:10,.0f} tok/s  {k} steps  {row['ms_per_step']:.2f} ms/step  "
                  f"masks {row['mask_ms_per_step']:.2f} ms/step  consume {row['consume_ms_per_step']:.2f} ms/step")
            if n / dt > best[name]:
                best[name], steps[name] = n / dt, row
    ratio = best["json_schema"] / best["unconstrained"]
    print(f"batch {a.batch} x {a.tokens} tokens: unconstrained {best['unconstrained']:,.0f} tok/s, "
          f"json_schema {best['json_schema']:,.0f} tok/s = {ratio:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.shape or os.path.basename(a.model), "device": a.device or "default",
                       "valid": valid, "num": a.num, "batch": a.batch, "tokens": a.tokens, "tok_s": best,
                       "ratio": ratio, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
