"""The engine on a CUDA device: the same greedy tokens as transformers (f32) and as llama2.c's
stories260K sample, every KV block back in the pool. Skips without a CUDA build and GPU."""
import numpy as np
import pytest

import tallow

if not tallow._core.build_info.get("cuda"):
    pytest.skip("this build of tallow has no CUDA backend", allow_module_level=True)
from tallow import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)
torch = pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
pytest.importorskip("transformers", reason="transformers is the reference model")

from engine_models import hf_greedy, make_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402

N_NEW = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_cuda")
    model = make_llama(path)
    rng = np.random.default_rng(99)
    prompts = [rng.integers(2, 320, n).tolist() for n in (3, 20, 41, 90)]
    return path, prompts, [hf_greedy(model, p, N_NEW) for p in prompts]


def assert_pool_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)


@pytest.mark.parametrize("engine_args", [dict(), dict(prefill_chunk_size=16, max_num_batched_tokens=32)],
                         ids=["default", "chunked"])
def test_cuda_greedy_f32_matches_transformers(llama_dir, engine_args):
    path, prompts, expected = llama_dir
    llm = LLM(str(path), device="cuda:0", dtype="float32", mem=64, **engine_args)
    assert llm.engine.device == "cuda:0"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pool_free(llm)


def test_cuda_bf16_close_to_cpu_f32(llama_dir):
    path, prompts, expected = llama_dir
    llm = LLM(str(path), device="cuda:0", dtype="bfloat16", mem=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
    # bf16 rounding may flip a near-tie late; the first tokens must agree
    agree = sum(o.outputs[0].token_ids[:4] == e[:4] for o, e in zip(outs, expected))
    assert agree >= len(prompts) - 1
    assert_pool_free(llm)


def test_cuda_stories260k(shared_data):
    llm = LLM(str(shared_data / "stories260K" / "stories260K.gguf"), device="cuda:0", dtype="float32", mem=64)
    ref = (shared_data / "stories260K" / "greedy.txt").read_text()
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(temperature=0, max_tokens=256))[0].outputs[0]
    assert out.text == ref.rstrip("\n")
    assert_pool_free(llm)
