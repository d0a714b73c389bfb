"""safetensors checkpoints as zero-copy tallow tensors over read-only memory maps.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
the byte after the header) plus an optional "__metadata__" dict of strings, then the data.
The header is parsed here (no safetensors/torch import at run time); each tensor is created on
first access as a tallow tensor over the mapped bytes, so nothing is read into Python memory and
pages are only touched when a kernel reads them.

Sharded checkpoints are described by ``model.safetensors.index.json`` ({"weight_map": {name: file}}).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
# a header larger than this is not a header (the reference implementation caps it at 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> (tallow dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3", 1),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "I32": ("int32", 4),
    "I64": ("int64", 8),
    "BOOL": ("bool", 1),
}
# known to the format but not to tallow: named in the error message
_OTHER_DTYPES = {"F64", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "I16", "U16", "U32", "U64", "C64"}


class SafetensorsError(ValueError):
    """A safetensors file or index that cannot be used; the message names the file and the problem."""


class SafetensorsFileNotFoundError(SafetensorsError, FileNotFoundError):
    """A checkpoint file (or a shard named by the index) does not exist."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name: "F32", "BF16", ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    path: str

    @property
    def tallow_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile(Mapping):
    """One .safetensors file: `infos` (name -> TensorInfo), `metadata` (the __metadata__ dict),
    and `file[name]` -> zero-copy tallow Tensor. Every header entry is validated on open."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                if size == 0:
                    raise SafetensorsError(f"{self.path}: empty file, not a safetensors checkpoint")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise SafetensorsFileNotFoundError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise SafetensorsError(f"{self.path}: is a directory, not a safetensors file") from None
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot map file ({e.strerror or e})") from None
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.size = size
        self.metadata: dict[str, str] = {}
        self.infos: dict[str, TensorInfo] = {}
        self._parse()

    def _fail(self, problem: str):
        raise SafetensorsError(f"{self.path}: {problem}")

    def _parse(self) -> None:
        if self.size < 8:
            self._fail(f"truncated safetensors header (file has {self.size} bytes, the length field alone needs 8)")
        (n,) = struct.unpack_from("<Q", self._mm, 0)
        if n > MAX_HEADER_BYTES:
            self._fail(f"corrupt safetensors header: header length {n} is implausible (not a safetensors file?)")
        if 8 + n > self.size:
            self._fail(f"truncated safetensors header: header needs {8 + n} bytes, file has {self.size}")
        try:
            header = json.loads(bytes(self._mm[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"corrupt safetensors header: not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail("corrupt safetensors header: the JSON is not an object")
        data_start = 8 + n
        data_size = self.size - data_start
        meta = header.pop("__metadata__", None)
        if meta is not None:
            if not isinstance(meta, dict):
                self._fail("corrupt safetensors header: __metadata__ is not an object")
            self.metadata = {str(k): v for k, v in meta.items()}
        for name, entry in header.items():
            if not isinstance(entry, dict):
                self._fail(f"corrupt safetensors header: entry for tensor {name!r} is not an object")
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if not isinstance(dtype, str):
                self._fail(f"corrupt safetensors header: tensor {name!r} has no dtype")
            if (not isinstance(shape, list) or
                    not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                self._fail(f"corrupt safetensors header: tensor {name!r} has an invalid shape {shape!r}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or
                    not 0 <= offsets[0] <= offsets[1]):
                self._fail(f"corrupt safetensors header: tensor {name!r} has invalid data_offsets {offsets!r}")
            if dtype not in DTYPES:
                what = "is not supported by tallow" if dtype in _OTHER_DTYPES else "is not a safetensors dtype"
                self._fail(f"tensor {name!r} has dtype {dtype}, which {what} "
                           f"(supported: {', '.join(DTYPES)})")
            numel = 1
            for d in shape:
                numel *= d
            need = numel * DTYPES[dtype][1]
            if offsets[1] - offsets[0] != need:
                self._fail(f"corrupt safetensors header: tensor {name!r} ({dtype}{shape}) needs {need} bytes "
                           f"but data_offsets {offsets} span {offsets[1] - offsets[0]}")
            if offsets[1] > data_size:
                self._fail(f"tensor {name!r} spans bytes {offsets[0]}..{offsets[1]} of the data section, which "
                           f"holds only {data_size} bytes (truncated file?)")
            self.infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + offsets[0],
                                          data_start + offsets[1], self.path)

    # -- Mapping -------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        info = self.infos.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self.tensor(info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array over the map (no copy)."""
        info = self.infos[name]
        return self._buf[info.begin:info.end]

    def tensor(self, info: TensorInfo):
        from tallow import _core

        raw = self._buf[info.begin:info.end]
        itemsize = DTYPES[info.dtype][1]
        if raw.ctypes.data % itemsize:
            # The format does not promise aligned data; kernels may assume it, so copy the rare
            # misaligned tensor (np.empty gives an aligned buffer).
            aligned = np.empty(raw.nbytes, dtype=np.uint8)
            aligned[:] = raw
            raw = aligned
        return _core.from_buffer(raw, info.tallow_dtype, list(info.shape))

    def close(self) -> None:
        """Drop this reader's reference to the map; it closes once no tensor uses it."""
        self._buf = None
        self.infos = {}

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, tensors={len(self.infos)})"


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise SafetensorsFileNotFoundError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt index file: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{path}: corrupt index file: no \"weight_map\" object of tensor name -> file name")
    return weight_map


def find_safetensors(path: str | os.PathLike) -> list[str] | None:
    """The checkpoint files of a directory (index shards, else model*.safetensors, else every
    *.safetensors), or None when it holds none."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        return sorted({os.path.join(path, f) for f in _read_index(index).values()})
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and
                   os.path.isfile(os.path.join(path, f)))
    preferred = [f for f in files if f.startswith("model")]
    files = preferred or files
    return [os.path.join(path, f) for f in files] or None


class SafetensorsCheckpoint(Mapping):
    """A whole checkpoint: one .safetensors file, an index JSON, or a directory (index if present,
    else its .safetensors files). Maps tensor name -> tallow Tensor, created lazily on access as
    a zero-copy view of the memory-mapped file; `infos` gives dtype/shape/file without touching data.

    >>> ckpt = SafetensorsCheckpoint("path/to/model")  # doctest: +SKIP
    >>> ckpt["model.embed_tokens.weight"]                # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        self.files: dict[str, SafetensorsFile] = {}
        self.infos: dict[str, TensorInfo] = {}
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_NAME)
            if os.path.isfile(index):
                self._load_index(index)
                return
            files = find_safetensors(path)
            if not files:
                raise SafetensorsFileNotFoundError(f"{path}: no .safetensors files in this directory")
            for f in files:
                self._add_file(f)
        elif path.endswith(".json"):
            self._load_index(path)
        else:
            self._add_file(path)

    def _add_file(self, file: str, names: list[str] | None = None) -> SafetensorsFile:
        st = self.files.get(file)
        if st is None:
            st = self.files[file] = SafetensorsFile(file)
        for name in (st.infos if names is None else names):
            info = st.infos.get(name)
            if info is None:
                raise SafetensorsError(f"{file}: the index lists tensor {name!r} in this file, but the file "
                                       "does not contain it")
            other = self.infos.get(name)
            if other is not None and other.path != file:
                raise SafetensorsError(f"tensor {name!r} is in both {other.path} and {file}")
            self.infos[name] = info
        return st

    def _load_index(self, index: str) -> None:
        weight_map = _read_index(index)
        base = os.path.dirname(index)
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(os.path.join(base, file), []).append(name)
        missing = [f for f in by_file if not os.path.isfile(f)]
        if missing:
            raise SafetensorsFileNotFoundError(
                f"{index}: shard(s) listed in the index are missing: {', '.join(sorted(missing))}")
        for file in sorted(by_file):
            self._add_file(file, by_file[file])

    @property
    def metadata(self) -> dict[str, Any]:
        """__metadata__ of the first file (HF writes {"format": "pt"})."""
        for f in self.files.values():
            return f.metadata
        return {}

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def __getitem__(self, name: str):
        info = self.infos.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self.files[info.path].tensor(info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({self.path!r}, files={len(self.files)}, tensors={len(self.infos)})"


def load_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of a checkpoint (file, index or directory) as a dict of zero-copy tallow tensors."""
    ckpt = SafetensorsCheckpoint(path)
    return {name: ckpt[name] for name in ckpt}
