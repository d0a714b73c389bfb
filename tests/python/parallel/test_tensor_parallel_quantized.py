"""Tensor parallelism with quantized weights on the CPU: each weight format loads its own shard (issue 25,
item 3). GPTQ (act-order), AWQ and block-FP8 checkpoints (tests/python/models/test_quantized_checkpoints.py's
writers) and --isq GGUF block types quantized at load (each rank its shard): TP=2 greedy tokens equal TP=1's (float32 compute, 2
prompts x 16 tokens), so the shard each rank takes (rows of column-parallel layers, columns of
row-parallel ones, groups and scales with them) is the right one."""
from __future__ import annotations

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) writes the checkpoints")
pytest.importorskip("transformers", reason="transformers writes the checkpoints")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))  # the checkpoint writers
import test_quantized_checkpoints as Q  # noqa: E402
from quant_models import make_llama, prompts  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402

ENGINE = dict(num_kv_blocks=32, block_size=16, max_model_len=128, dtype="float32")


def _tokens(path, tp: int, **extra) -> list[list[int]]:
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE, **extra)
    try:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("case_id", ["llama-gptq4-g32-actorder-asym", "llama-awq-g64", "llama-fp8-block",
                                     "qwen3-gptq4-g128-actorder"])
def test_checkpoint_formats_shard(tmp_path, case_id):
    arch, case = Q.CASES[case_id]
    Q.write_quantized(tmp_path, arch, case)
    assert _tokens(tmp_path, 2) == _tokens(tmp_path, 1)


@pytest.mark.parametrize("isq", ["q8_0", "q4_k"])
def test_isq_block_types_shard(tmp_path, isq):
    """Each rank quantizes its own shard at load. Sizes whose per-rank rows hold whole 256-value K-quant
    blocks (hidden 512, MLP 1024: the row-parallel layers' 256 and 512 columns a rank), so TP=1 and TP=2
    pick the same block types and quantize the same blocks."""
    make_llama(tmp_path, seed=5, hidden_size=512, head_dim=128, intermediate_size=1024)
    assert _tokens(tmp_path, 2, quantization=isq) == _tokens(tmp_path, 1, quantization=isq)


def test_gguf_file_shards(tmp_path):
    """A GGUF file in llama.cpp's Q4_K_M mix (`tallow quantize`): its block tensors are sliced per rank as
    they load (whole blocks: the sizes above)."""
    from tallow.cli import main

    make_llama(tmp_path / "m", seed=6, hidden_size=512, head_dim=128, intermediate_size=1024)
    out = tmp_path / "m.q4_k_m.gguf"
    assert main(["quantize", str(tmp_path / "m"), str(out), "--type", "q4_k_m"]) == 0
    assert _tokens(out, 2) == _tokens(out, 1)
