"""Bad input to the weight loaders: each case raises one clear error (a ValueError subclass or a
FileNotFoundError) whose message names the file and the problem."""
import json
import struct

import numpy as np
import pytest

import tallow

from tallow.loader.gguf_reader import GGUFError, GGUFFile
from tallow.loader.safetensors_loader import SafetensorsCheckpoint, SafetensorsError
from tallow.loader.source import ModelSourceError, load_weights, resolve_model_source

st_numpy = pytest.importorskip("safetensors.numpy")
gguf = pytest.importorskip("gguf")


def expect_error(fn, path, *words, kind=(ValueError, FileNotFoundError)):
    with pytest.raises(kind) as info:
        fn()
    msg = str(info.value)
    assert str(path) in msg, f"message does not name {path}: {msg}"
    for w in words:
        assert w.lower() in msg.lower(), f"message lacks {w!r}: {msg}"
    assert "\n" not in msg and "Traceback" not in msg
    return info.value


def load_via_source(path):
    return lambda: load_weights(resolve_model_source(f=str(path)) if str(path).endswith(".gguf")
                                else resolve_model_source(w=str(path)))


# -- missing files -------------------------------------------------------------------------------
def test_missing_files(tmp_path):
    st = tmp_path / "missing.safetensors"
    expect_error(lambda: SafetensorsCheckpoint(st), st, "no such file", kind=FileNotFoundError)
    gg = tmp_path / "missing.gguf"
    expect_error(lambda: GGUFFile(gg), gg, "no such file", kind=FileNotFoundError)
    expect_error(lambda: resolve_model_source(f=str(gg)), gg, "no such", kind=FileNotFoundError)
    d = tmp_path / "missing-dir"
    expect_error(lambda: resolve_model_source(w=str(d)), d, "no such", kind=FileNotFoundError)
    expect_error(lambda: resolve_model_source(m=str(d)), d, "no such", kind=FileNotFoundError)


def test_no_model_given():
    with pytest.raises(ModelSourceError, match="--m"):
        resolve_model_source()


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    err = expect_error(lambda: resolve_model_source(w=str(tmp_path)), tmp_path, "no model weights")
    assert isinstance(err, ValueError)
    expect_error(lambda: SafetensorsCheckpoint(tmp_path), tmp_path, "no .safetensors", kind=FileNotFoundError)


def test_directory_with_several_ggufs(tmp_path):
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).write_bytes(b"GGUF")
    expect_error(lambda: resolve_model_source(w=str(tmp_path)), tmp_path, "a.gguf", "b.gguf", "--f")


def test_not_a_model_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    expect_error(lambda: resolve_model_source(m=str(p)), p, "not a model")


# -- safetensors ---------------------------------------------------------------------------------
@pytest.fixture
def st_file(tmp_path, rng):
    path = tmp_path / "model.safetensors"
    st_numpy.save_file({"a": rng.standard_normal((16, 16)).astype(np.float32),
                        "b": rng.standard_normal(8).astype(np.float32)}, str(path))
    return path


def _header_len(path):
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("where", ["empty", "length", "header", "data"])
def test_truncated_safetensors(st_file, where):
    data = st_file.read_bytes()
    n = _header_len(st_file)
    cut = {"empty": 0, "length": 5, "header": 8 + n // 2, "data": len(data) - 10}[where]
    st_file.write_bytes(data[:cut])
    word = "empty" if where == "empty" else "truncated"
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, word)
    expect_error(load_via_source(st_file.parent), st_file, word)


def _rewrite_header(path, header: dict | bytes, data: bytes):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_corrupt_safetensors_headers(st_file):
    data = st_file.read_bytes()
    n = _header_len(st_file)
    header, body = json.loads(data[8:8 + n]), data[8 + n:]

    st_file.write_bytes(struct.pack("<Q", 1 << 60) + data[8:])
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "corrupt", "header length")

    _rewrite_header(st_file, b"{not json" + b" " * 20, body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "not valid JSON")

    _rewrite_header(st_file, b"[1, 2, 3]", body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "not an object")

    bad = json.loads(json.dumps(header))
    bad["a"]["shape"] = [16, 17]
    _rewrite_header(st_file, bad, body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "'a'", "needs")

    bad = json.loads(json.dumps(header))
    bad["a"]["shape"] = [-1, 16]
    _rewrite_header(st_file, bad, body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "'a'", "invalid shape")

    bad = json.loads(json.dumps(header))
    del bad["b"]["data_offsets"]
    _rewrite_header(st_file, bad, body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "'b'", "data_offsets")


def test_tensor_spans_outside_file(st_file):
    data = st_file.read_bytes()
    n = _header_len(st_file)
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    header["c"] = {"dtype": "F32", "shape": [4], "data_offsets": [len(body) + 100, len(body) + 116]}
    _rewrite_header(st_file, header, body)
    expect_error(lambda: SafetensorsCheckpoint(st_file), st_file, "'c'", "spans")


def test_unsupported_safetensors_dtype(tmp_path):
    path = tmp_path / "f64.safetensors"
    st_numpy.save_file({"w64": np.zeros(4, np.float64)}, str(path))
    err = expect_error(lambda: SafetensorsCheckpoint(path), path, "'w64'", "F64", "not supported")
    assert isinstance(err, SafetensorsError)
    _rewrite_header(path, {"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")
    expect_error(lambda: SafetensorsCheckpoint(path), path, "'x'", "Q4")


def test_bad_index(tmp_path, rng):
    st_numpy.save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model-1.safetensors"))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text("{broken")
    expect_error(lambda: SafetensorsCheckpoint(tmp_path), idx, "not valid JSON")
    idx.write_text(json.dumps({"metadata": {}}))
    expect_error(lambda: SafetensorsCheckpoint(tmp_path), idx, "weight_map")


# -- GGUF ----------------------------------------------------------------------------------------
def _write_gguf(path, rng, arch="llama", tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    tensors = tensors or {
        "token_embd.weight": rng.standard_normal((8, 256)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((256, 256)).astype(np.float32),
        "output_norm.weight": rng.standard_normal(256).astype(np.float32),
    }
    for n, a in tensors.items():
        w.add_tensor(n, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def _offset_of_tensor_type(data: bytes, name: str, n_dims: int) -> int:
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key)
    return pos + len(key) + 4 + 8 * n_dims


@pytest.mark.parametrize("where", ["empty", "magic", "counts", "metadata", "tensor_infos", "data"])
def test_truncated_gguf(tmp_path, rng, where):
    path = _write_gguf(tmp_path / "m.gguf", rng)
    data = path.read_bytes()
    info_pos = data.index(b"token_embd.weight") - 8
    cut = {"empty": 0, "magic": 3, "counts": 12, "metadata": data.index(b"general.name") + 4,
           "tensor_infos": info_pos + 10, "data": len(data) - 100}[where]
    path.write_bytes(data[:cut])
    word = {"empty": "empty", "magic": "not a GGUF"}.get(where, "truncated")
    err = expect_error(lambda: GGUFFile(path), path, word)
    assert isinstance(err, GGUFError)
    expect_error(load_via_source(path), path, word)


def test_corrupt_gguf(tmp_path, rng):
    path = _write_gguf(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    bad = bytes(b"GGML" + data[4:])
    path.write_bytes(bad)
    expect_error(lambda: GGUFFile(path), path, "not a GGUF")
    path.write_bytes(bytes(data[:4]) + struct.pack("<I", 99) + bytes(data[8:]))
    expect_error(lambda: GGUFFile(path), path, "version 99")
    # a metadata value type that does not exist
    pos = data.index(b"general.name") + len(b"general.name")
    data[pos:pos + 4] = struct.pack("<I", 77)
    path.write_bytes(bytes(data))
    expect_error(lambda: GGUFFile(path), path, "value type 77")


@pytest.mark.parametrize("type_id,words", [(16, ("IQ2_XXS", "not support")), (200, ("unknown type 200",))])
def test_unknown_gguf_tensor_type(tmp_path, rng, type_id, words):
    path = _write_gguf(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    pos = _offset_of_tensor_type(bytes(data), "blk.0.attn_q.weight", 2)
    assert struct.unpack_from("<I", data, pos)[0] == 0  # F32 before patching
    data[pos:pos + 4] = struct.pack("<I", type_id)
    path.write_bytes(bytes(data))
    g = GGUFFile(path)  # the header itself is fine
    err = expect_error(lambda: g.tensor("blk.0.attn_q.weight"), path, "'blk.0.attn_q.weight'", *words)
    assert isinstance(err, GGUFError)
    expect_error(load_via_source(path), path, "'blk.0.attn_q.weight'", *words)


def test_gguf_rows_not_whole_blocks(tmp_path, rng):
    path = _write_gguf(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    pos = _offset_of_tensor_type(bytes(data), "token_embd.weight", 2)
    data[pos - 16:pos - 8] = struct.pack("<Q", 100)  # ne0 = 100 elements per row
    data[pos:pos + 4] = struct.pack("<I", 8)  # Q8_0: 32-element blocks
    path.write_bytes(bytes(data))
    expect_error(lambda: GGUFFile(path), path, "'token_embd.weight'", "blocks")


def test_gguf_unknown_architecture(tmp_path, rng):
    path = _write_gguf(tmp_path / "m.gguf", rng, arch="mamba")
    expect_error(load_via_source(path), path, "'mamba'", "not supported")


# -- GGUF tensors tallow cannot compute, and truncated block data (files written by gguf-py) -------------
def _write_raw_gguf(path, tensors: dict):
    """A llama GGUF holding `tensors` ({name: (ggml type, uint8 [rows, bytes per row])}) as raw blocks."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    for n, (qtype, raw) in tensors.items():
        w.add_tensor(n, raw, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def _raw_blocks(rng, qtype, rows, k):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(rows, k // bs * ts), dtype=np.uint8)


UNCOMPUTED = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4"]


@pytest.mark.parametrize("type_name", UNCOMPUTED)
def test_gguf_type_tallow_does_not_compute(tmp_path, rng, type_name):
    from tallow.loader.gguf_weights import GGUFWeights

    Q = gguf.GGMLQuantizationType
    qtype = getattr(Q, type_name)
    path = _write_raw_gguf(tmp_path / "m.gguf", {
        "token_embd.weight": (Q.Q8_0, _raw_blocks(rng, Q.Q8_0, 8, 256)),
        "blk.0.ffn_down.weight": (qtype, _raw_blocks(rng, qtype, 16, 256)),
    })
    g = GGUFFile(path)  # the header is fine: sizes of every ggml type are known
    assert g.tensors["blk.0.ffn_down.weight"].type_name == type_name
    words = ("'blk.0.ffn_down.weight'", type_name, "not support")
    # load_model asks for every tensor's dtype before it allocates the model: the error comes at load
    expect_error(lambda: GGUFWeights(path).dtypes(), path, *words)
    err = expect_error(load_via_source(path), path, *words)
    assert isinstance(err, GGUFError)


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS"])
def test_gguf_iq4_types_load(tmp_path, rng, type_name):
    from tallow.loader.gguf_weights import GGUFWeights

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = _raw_blocks(rng, qtype, 16, 512)
    path = _write_raw_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (qtype, raw)})
    t = GGUFWeights(path).weights()["model.layers.0.mlp.down_proj.weight"]
    assert t.dtype == getattr(tallow.DType, type_name.lower()) and tuple(t.shape) == (16, 512)
    np.testing.assert_array_equal(GGUFFile(path).raw("blk.0.ffn_down.weight"), raw)
    with np.errstate(invalid="ignore"):  # random bytes: some f16 scales are NaN/Inf, in both dequantizers
        ref = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(tallow.ops.dequantize(t, "float32").numpy(), ref)


def test_truncated_gguf_names_the_tensor(tmp_path, rng):
    Q = gguf.GGMLQuantizationType
    path = _write_raw_gguf(tmp_path / "m.gguf", {
        "blk.0.attn_v.weight": (Q.Q6_K, _raw_blocks(rng, Q.Q6_K, 32, 512)),
        "blk.0.ffn_down.weight": (Q.Q4_K, _raw_blocks(rng, Q.Q4_K, 64, 512)),
    })
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 64 * 144])  # half of the last tensor's blocks
    err = expect_error(lambda: GGUFFile(path), path, "truncated", "'blk.0.ffn_down.weight'")
    assert isinstance(err, GGUFError)
    expect_error(load_via_source(path), path, "truncated", "'blk.0.ffn_down.weight'")


def test_gguf_rows_not_whole_blocks_names_shape_and_type(tmp_path, rng):
    path = _write_gguf(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    pos = _offset_of_tensor_type(bytes(data), "token_embd.weight", 2)
    data[pos - 16:pos - 8] = struct.pack("<Q", 100)  # ne0 = 100 elements per row
    data[pos:pos + 4] = struct.pack("<I", 12)  # Q4_K: 256-element blocks
    path.write_bytes(bytes(data))
    expect_error(lambda: GGUFFile(path), path, "'token_embd.weight'", "Q4_K", "[8, 100]", "256-element blocks")
    expect_error(load_via_source(path), path, "'token_embd.weight'", "Q4_K", "[8, 100]")
