"""`tallow quantize SRC OUT.gguf --type T` from the command line: it writes a loadable GGUF and prints its
size and type histogram; bad input is one clear line (exit status 2), never a traceback."""
import json
import os
import subprocess
import sys

import pytest

from quant_models import has_quantize_op

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tallow_cli(*args):
    return subprocess.run([sys.executable, "-m", "tallow.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TALLOW_DEBUG": ""})


def _one_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[-1] if len(lines) == 1 else pytest.fail(f"expected one line, got: {r.stderr!r}")


@pytest.fixture
def config_dir(tmp_path):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=256,
               intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_unknown_type(config_dir):
    line = _one_line(tallow_cli("quantize", str(config_dir), str(config_dir / "o.gguf"), "--type", "q9_k"))
    assert "q9_k" in line and "q4_k_m" in line and "q4k" in line


def test_missing_src(tmp_path):
    line = _one_line(tallow_cli("quantize", str(tmp_path / "nope"), str(tmp_path / "o.gguf"), "--type", "q4k"))
    assert "nope" in line and "no such" in line


def test_missing_type(tmp_path):
    line = _one_line(tallow_cli("quantize", str(tmp_path), str(tmp_path / "o.gguf")))
    assert "--type" in line


def test_row_not_whole_blocks_falls_back_with_one_line(tmp_path):
    """hidden 576 (SmolLM2's): no 256-element K-quant block fits; llama.cpp's fallback Q5_0, logged."""
    if not has_quantize_op():
        pytest.skip("this build has no tallow.ops.quantize yet (needed for q4k)")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=576,
               intermediate_size=256, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
               max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    r = tallow_cli("quantize", str(tmp_path), str(out), "--type", "q4k", "--load-format", "dummy")
    assert r.returncode == 0, r.stderr
    assert "falling back to q5_0" in r.stderr and "Traceback" not in r.stderr
    assert "wrote" in r.stdout and "Q5_0" in r.stdout and "Q4_K" in r.stdout  # down_proj (K=256) stays Q4_K
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["token_embd.weight"] == "Q8_0"  # tied output, 576 not whole Q4_K blocks: Q8_0 (llama.cpp)


def test_dummy_quantize_writes_and_loads(config_dir, tmp_path):
    if not has_quantize_op():
        pytest.skip("this build has no tallow.ops.quantize yet (needed for q4_k_m)")
    out = tmp_path / "o.gguf"
    r = tallow_cli("quantize", str(config_dir), str(out), "--type", "q4_k_m", "--load-format", "dummy")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "MiB" in r.stdout and "Q6_K" in r.stdout
    from tallow.loader.gguf_reader import GGUFFile

    g = GGUFFile(str(out))
    assert g.metadata["general.file_type"] == 15
    assert str(g.dtype("output.weight")).lower().endswith("q6_k")
