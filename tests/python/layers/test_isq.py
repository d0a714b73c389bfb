"""In-situ quantization (--isq / LLM(quantization=...)): the per-tensor type rules (llama.cpp's), and a
random-weight checkpoint quantized while loading gives the same logits, bit for bit on the CPU, as the GGUF
`tallow quantize` writes from it, loaded back through tallow."""
import logging
import subprocess
import sys

import numpy as np
import pytest

from quant_models import has_quantize_op, make_llama, numpy_quantize_shim, prompts, run
from tallow.layers.quantization.isq import ISQ_NAMES, QuantScheme, export_scheme, isq_scheme


# -- names ----------------------------------------------------------------------------------------
def test_isq_names():
    assert isq_scheme("q4k").base == "q4_k"
    assert isq_scheme("Q6_K").base == "q6_k"
    assert isq_scheme("q8_0").base == "q8_0"
    assert {isq_scheme(n).base for n in ISQ_NAMES} == {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k",
                                                       "q4_k", "q5_k", "q6_k"}
    with pytest.raises(ValueError) as e:
        isq_scheme("q9k")
    assert "q9k" in str(e.value) and "q4k" in str(e.value) and "q4_0" in str(e.value)
    with pytest.raises(ValueError):
        isq_scheme("q4_k_m")  # llama.cpp's mixes are for `tallow quantize`, not --isq
    assert export_scheme("q4_k_m").mix == "q4_k_m" and export_scheme("q4_k_m").file_type == 15
    assert export_scheme("q4k").mix is None


def test_engine_args_reject_unknown_isq():
    from tallow.engine.args import EngineArgs

    with pytest.raises(ValueError, match="valid: q4_0"):
        EngineArgs(model="x", quantization="q7k")


def test_cli_unknown_isq_is_one_line():
    r = subprocess.run([sys.executable, "-m", "tallow.cli", "generate", "--w", "/nonexistent", "--isq", "q7k", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "q7k" in lines[0] and "q4k" in lines[0] and "Traceback" not in r.stderr


# -- the type rules -------------------------------------------------------------------------------
def test_output_and_embedding_types():
    s = QuantScheme("q4k", "q4_k")
    assert s.tensor_type("output", -1, 2, 4096, "lm_head.weight") == "q6_k"
    assert s.tensor_type("token_embd", -1, 2, 4096, "e") == "q4_k"
    assert s.tensor_type("attn_q", 0, 2, 4096, "q") == "q4_k"
    assert QuantScheme("q8_0", "q8_0").tensor_type("output", -1, 2, 4096, "o") == "q8_0"
    assert QuantScheme("q4_0", "q4_0").tensor_type("output", -1, 2, 4096, "o") == "q6_k"
    # an output row that is not whole blocks of the scheme's type: Q8_0 (llama.cpp)
    assert QuantScheme("q4k", "q4_k").tensor_type("output", -1, 2, 576, "o") == "q8_0"


def test_fallbacks_log_one_line(caplog):
    s = QuantScheme("q4k", "q4_k")
    with caplog.at_level(logging.WARNING, logger="tallow.isq"):
        assert s.tensor_type("attn_q", 0, 30, 576, "model.layers.0.self_attn.q_proj.weight") == "q5_0"
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "q_proj" in msg and "576" in msg and "q5_0" in msg
    assert QuantScheme("q6k", "q6_k").tensor_type("ffn_down", 0, 30, 1536 + 32, "d") == "q8_0"
    assert QuantScheme("q5k", "q5_k").tensor_type("ffn_down", 0, 30, 1536 + 32, "d") == "q5_1"
    assert QuantScheme("q2k", "q2_k").tensor_type("ffn_down", 0, 30, 1536 + 32, "d") == "q4_0"
    # no block divides the row (stories260K's MLP of 172): float16, as llama.cpp's last resort
    assert QuantScheme("q8_0", "q8_0").tensor_type("ffn_down", 0, 5, 172, "d") == "float16"
    assert QuantScheme("q4k", "q4_k").tensor_type("ffn_down", 0, 5, 172, "d") == "float16"


def test_q4_k_m_mix_follows_llama_cpp():
    s = export_scheme("q4_k_m")
    n = 32
    # llama.cpp's use_more_bits(i, 32): i < 4, i >= 28, (i - 4) % 3 == 2
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for i in range(n):
        want = "q6_k" if i in more else "q4_k"
        assert s.tensor_type("attn_v", i, n, 4096, "v") == want, i
        assert s.tensor_type("ffn_down", i, n, 14336, "d") == want, i
        assert s.tensor_type("attn_q", i, n, 4096, "q") == "q4_k"
        assert s.tensor_type("ffn_up", i, n, 4096, "u") == "q4_k"
        assert s.tensor_type("attn_output", i, n, 4096, "o") == "q4_k"
    assert s.tensor_type("output", -1, n, 4096, "o") == "q6_k"
    assert s.tensor_type("token_embd", -1, n, 4096, "e") == "q4_k"
    s = export_scheme("q4_k_s")
    assert [s.tensor_type("attn_v", i, n, 4096, "v") for i in range(6)] == ["q5_k"] * 4 + ["q4_k"] * 2
    assert [s.tensor_type("ffn_down", i, n, 4096, "v") for i in (0, 3, 4)] == ["q5_k", "q5_k", "q4_k"]
    s = export_scheme("q3_k_m")
    assert [s.tensor_type("attn_v", i, n, 4096, "v") for i in range(3)] == ["q5_k", "q5_k", "q4_k"]
    assert s.tensor_type("attn_output", 5, n, 4096, "o") == "q4_k"
    assert [s.tensor_type("ffn_down", i, n, 4096, "v") for i in (0, 1, 2)] == ["q5_k", "q5_k", "q4_k"]


# -- the model ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("isq_llama")
    model = make_llama(path)
    return path, model


def _needs_quantize(monkeypatch, t):
    if has_quantize_op():
        return
    if t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        numpy_quantize_shim(monkeypatch)
        return
    pytest.skip(f"{t}: this build has no tallow.ops.quantize yet (gguf-py's numpy quantize covers only "
                "q4_0..q8_0)")


@pytest.mark.parametrize("t", ["q4k", "q8_0", "q4_0"])
def test_isq_logits_equal_tallow_quantize_gguf(llama_dir, tmp_path, monkeypatch, t):
    from tallow.loader.gguf_export import export_gguf

    _needs_quantize(monkeypatch, t)
    path, _ = llama_dir
    ps = prompts()
    tok_isq, logits_isq, llm = run(str(path), ps, quantization=t)
    model = llm.engine.executor.worker.model
    base = isq_scheme(t).base
    down = model.layers[0].mlp.down_proj
    w = down.weight if down.weight is not None else down.weight_parts[0]
    assert w.dtype.name == base, f"the down projection is {w.dtype.name}, not {base}"
    head = model.lm_head.weight if model.lm_head.weight is not None else model.lm_head.weight_parts[0]
    assert head.dtype.name == ("q8_0" if base == "q8_0" else "q6_k")

    out = tmp_path / f"m-{t}.gguf"
    export_gguf(str(path), str(out), t)
    tok_gguf, logits_gguf, _ = run(str(out), ps)
    for a, b in zip(logits_isq, logits_gguf):
        assert np.array_equal(a, b), f"--isq {t} and its GGUF differ by {np.max(np.abs(a - b)):.3g}"
    assert tok_isq == tok_gguf


def test_isq_dummy_weights(tmp_path, monkeypatch):
    """--load-format dummy with --isq: random weights made on the device and quantized in place."""
    import json

    _needs_quantize(monkeypatch, "q8_0")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=128,
               intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tokens, logits, llm = run(str(tmp_path), [[5, 17, 200, 3, 99]], n_new=4, load_format="dummy",
                              quantization="q8_0")
    model = llm.engine.executor.worker.model
    assert model.embed_tokens.weight.dtype.name == "q8_0"  # tied: the output's type (Q8_0 scheme)
    assert np.all(np.isfinite(logits[0])) and np.std(logits[0]) > 0
    assert len(tokens[0]) == 4


def test_isq_on_gguf_is_a_clear_error(shared_data):
    from tallow import LLM

    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(shared_data / "stories260K" / "stories260K.gguf"), quantization="q8_0")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_isq_equals_gguf_other_families(arch, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied embeddings), Mistral (written as llama: q/k permuted)."""
    from tallow.loader.gguf_export import export_gguf

    path = tmp_path / arch
    path.mkdir()
    make_llama(path, seed=5, arch=arch)
    ps = prompts(1, 6, seed=3)
    tok_isq, logits_isq, _ = run(str(path), ps, n_new=4, quantization="q8_0")
    out = tmp_path / f"{arch}.gguf"
    export_gguf(str(path), str(out), "q8_0")
    tok_gguf, logits_gguf, llm = run(str(out), ps, n_new=4)
    assert llm.engine.config.family == ("llama" if arch == "mistral" else arch)
    assert np.array_equal(logits_isq[0], logits_gguf[0]) and tok_isq == tok_gguf
