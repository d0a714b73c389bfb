"""safetensors checkpoints -> zero-copy tallow tensors, checked bit-exactly against files written
by the `safetensors` package itself."""
import json
import os
import tracemalloc

import numpy as np
import pytest

import tallow
from tallow.loader.safetensors_loader import (
    SafetensorsCheckpoint,
    SafetensorsError,
    SafetensorsFile,
    load_safetensors,
)

st_numpy = pytest.importorskip("safetensors.numpy")


def _numpy_tensors(rng):
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "i8": rng.integers(-128, 128, (2, 3, 4), dtype=np.int8),
        "u8": rng.integers(0, 256, (9,), dtype=np.uint8),
        "i32": rng.integers(-2**31, 2**31, (4, 4), dtype=np.int32),
        "i64": rng.integers(-2**62, 2**62, (3,), dtype=np.int64),
        "bool": rng.integers(0, 2, (2, 5)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _in_map(t, f: SafetensorsFile) -> bool:
    base = f._buf.ctypes.data
    return base <= t.data_ptr < base + f.size


def test_numpy_dtypes_bit_exact_and_zero_copy(tmp_path, rng):
    ref = _numpy_tensors(rng)
    path = tmp_path / "model.safetensors"
    st_numpy.save_file(ref, str(path), metadata={"format": "pt"})
    ckpt = SafetensorsCheckpoint(path)
    assert set(ckpt) == set(ref)
    assert ckpt.metadata == {"format": "pt"}
    f = ckpt.files[str(path)]
    for name, arr in ref.items():
        t = ckpt[name]
        assert isinstance(t, tallow.Tensor)
        assert list(t.shape) == list(arr.shape), name
        assert t.dtype == tallow._core.dtype(arr.dtype), name
        got = t.numpy()
        assert got.dtype == arr.dtype
        assert got.tobytes() == arr.tobytes(), name
        if arr.size:
            assert _in_map(t, f), f"{name} was copied instead of mapped"


def test_bf16_and_fp8_via_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = {
        "bf16": torch.randn(6, 8, generator=g).to(torch.bfloat16),
        "fp8": (torch.randn(4, 16, generator=g) * 4).to(torch.float8_e4m3fn),
        "f32": torch.randn(5, generator=g),
    }
    path = tmp_path / "t.safetensors"
    st_torch.save_file(ref, str(path))
    ckpt = SafetensorsCheckpoint(path)
    t = ckpt["bf16"]
    assert t.dtype == tallow.bfloat16 and list(t.shape) == [6, 8]
    assert np.array_equal(t.numpy(raw=True), ref["bf16"].view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(t.to("float32").numpy(), ref["bf16"].float().numpy())
    t = ckpt["fp8"]
    assert t.dtype == tallow.float8_e4m3 and list(t.shape) == [4, 16]
    assert np.array_equal(t.numpy(raw=True), ref["fp8"].view(torch.uint8).numpy())
    assert np.array_equal(t.to("float32").numpy(), ref["fp8"].float().numpy())
    assert np.array_equal(ckpt["f32"].numpy(), ref["f32"].numpy())


def test_lazy_no_python_copy(tmp_path, rng):
    """Opening and indexing a 32 MiB checkpoint allocates (almost) nothing in Python memory."""
    big = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(8)}
    path = tmp_path / "big.safetensors"
    st_numpy.save_file(big, str(path))
    del big
    tracemalloc.start()
    try:
        ckpt = SafetensorsCheckpoint(path)
        tensors = {n: ckpt[n] for n in ckpt}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tensors) == 8
    assert peak < 1 << 20, f"loading allocated {peak} bytes"
    # and the values are the file's
    arr = np.frombuffer(open(path, "rb").read()[-4 * 1024 * 1024:], dtype=np.float32).reshape(1024, 1024)
    last = max(ckpt.infos, key=lambda n: ckpt.infos[n].end)
    assert np.array_equal(tensors[last].numpy(), arr)


def _write_sharded(tmp_path, rng, n_shards=3):
    ref, weight_map = {}, {}
    for s in range(n_shards):
        shard = {f"model.layers.{s}.w{i}": rng.standard_normal((4, 3)).astype(np.float32) for i in range(2)}
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        st_numpy.save_file(shard, str(tmp_path / fname))
        ref.update(shard)
        weight_map.update({k: fname for k in shard})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return ref


def test_sharded_checkpoint(tmp_path, rng):
    ref = _write_sharded(tmp_path, rng)
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        ckpt = SafetensorsCheckpoint(path)
        assert len(ckpt.files) == 3
        assert set(ckpt) == set(ref)
        for k, v in ref.items():
            assert ckpt[k].numpy().tobytes() == v.tobytes()
            assert ckpt.infos[k].path.endswith(".safetensors")
    assert set(load_safetensors(tmp_path)) == set(ref)


def test_sharded_missing_shard(tmp_path, rng):
    _write_sharded(tmp_path, rng)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_index_names_tensor_not_in_shard(tmp_path, rng):
    _write_sharded(tmp_path, rng)
    idx = tmp_path / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    idx.write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match=r"model-00001-of-00003\.safetensors.*'ghost\.weight'"):
        SafetensorsCheckpoint(tmp_path)


def test_directory_without_index_loads_every_file(tmp_path, rng):
    a = {"a": rng.standard_normal(3).astype(np.float32)}
    b = {"b": rng.standard_normal(3).astype(np.float32)}
    st_numpy.save_file(a, str(tmp_path / "model-a.safetensors"))
    st_numpy.save_file(b, str(tmp_path / "model-b.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert set(ckpt) == {"a", "b"}


def test_duplicate_tensor_across_files(tmp_path, rng):
    a = {"a": rng.standard_normal(3).astype(np.float32)}
    st_numpy.save_file(a, str(tmp_path / "model-1.safetensors"))
    st_numpy.save_file(a, str(tmp_path / "model-2.safetensors"))
    with pytest.raises(SafetensorsError, match="'a' is in both"):
        SafetensorsCheckpoint(tmp_path)


def test_tensor_outlives_checkpoint(tmp_path, rng):
    ref = rng.standard_normal((16, 16)).astype(np.float32)
    path = tmp_path / "m.safetensors"
    st_numpy.save_file({"w": ref}, str(path))
    ckpt = SafetensorsCheckpoint(path)
    t = ckpt["w"]
    ckpt.close()
    del ckpt
    import gc

    gc.collect()
    assert np.array_equal(t.numpy(), ref)
