"""A GGUF (v2/v3) reader: metadata of every value type, tensor infos, and tensors as zero-copy
tallow tensors over a read-only memory map of the file. Format: llama.cpp's docs/gguf.md."""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}
_NUMPY = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
    _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64, _INT64: np.int64,
    _FLOAT64: np.float64,
}


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file and the problem."""


@dataclasses.dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's ne[] reversed
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


class GGUFFile:
    """Open a GGUF file. `metadata` maps keys to Python values (numeric arrays as numpy arrays,
    string arrays as lists of str); `tensors` maps names to GGUFTensorInfo; `tensor(name)` gives a
    zero-copy tallow tensor (block dtypes included) backed by the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except (ValueError, OSError) as e:  # empty file cannot be mapped
            raise GGUFError(f"{self.path}: cannot map file ({e})") from None
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF header ({e})") from None

    # -- parsing ---------------------------------------------------------------------------
    def _read(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise GGUFError(f"{self.path}: truncated GGUF (needs {self._pos + size} bytes, file has {len(self._buf)})")
        v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += size
        return v

    def _read_str(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path}: truncated GGUF string of {n} bytes at offset {self._pos}")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _read_value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._read(_SCALAR[vtype])
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            itype = self._read("<I")
            n = self._read("<Q")
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
                end = self._pos + n * dt.itemsize
                if end > len(self._buf):
                    raise GGUFError(f"{self.path}: truncated GGUF array at offset {self._pos}")
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._pos).copy()
                self._pos = end
                return arr
            return [self._read_value(itype) for _ in range(n)]
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at offset {self._pos}")

    def _parse(self) -> None:
        if len(self._buf) < 4 or bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            vtype = self._read("<I")
            self.metadata[key] = self._read_value(vtype)
        from tallow import _core

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            ne = [self._read("<Q") for _ in range(n_dims)]
            ggml_type = self._read("<I")
            offset = self._read("<Q")
            shape = tuple(int(d) for d in reversed(ne))
            try:
                dt = _core.dtype_from_ggml_type(ggml_type)
            except TypeError:
                dt = None  # reported when the tensor is used
            numel = int(np.prod(shape)) if shape else 1
            nbytes = dt.nbytes(numel) if dt is not None else 0
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: invalid general.alignment {self.alignment}")
        self.data_offset = (self._pos + self.alignment - 1) // self.alignment * self.alignment
        for info in self.tensors.values():
            end = self.data_offset + info.offset + info.nbytes
            if end > len(self._buf):
                raise GGUFError(
                    f"{self.path}: truncated GGUF: tensor {info.name!r} ends at byte {end}, file has {len(self._buf)}")

    # -- access ------------------------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str):
        """Zero-copy tallow tensor over the mapped bytes (the map stays open while it lives)."""
        from tallow import _core

        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        try:
            dt = _core.dtype_from_ggml_type(info.ggml_type)
        except TypeError as e:
            raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from None
        start = self.data_offset + info.offset
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=start)
        return _core.from_buffer(raw, dt, list(info.shape))

    def close(self) -> None:
        """Drop this reader's references; the map closes once no tensor uses it."""
        self._buf = None  # tensors keep their own numpy views of the map alive

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={self.architecture}, tensors={len(self.tensors)}, kv={len(self.metadata)})"
