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


# ggml tensor types: id -> (name, elements per block, bytes per block), as in ggml.h / gguf-py.
# Types tallow cannot compute with are still sized here, so a truncated file is caught at open
# time and the error for using one of them names the type.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


def ggml_type_name(ggml_type: int) -> str:
    entry = GGML_TYPES.get(ggml_type)
    return entry[0] if entry else f"unknown type {ggml_type}"


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file and the problem."""


class GGUFFileNotFoundError(GGUFError, FileNotFoundError):
    """The GGUF file does not exist (both a GGUFError and a FileNotFoundError)."""


@dataclasses.dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): GGUF's ne[] reversed
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int  # 0 when the type is unknown

    @property
    def type_name(self) -> str:
        """The ggml type's name ("F32", "Q4_K", ...)."""
        return ggml_type_name(self.ggml_type)


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
            raise GGUFFileNotFoundError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except (ValueError, OSError) as e:  # an empty file cannot be mapped
            if os.path.isfile(self.path) and os.path.getsize(self.path) == 0:
                raise GGUFError(f"{self.path}: empty file, not a GGUF file") from None
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
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            numel = 1
            for d in shape:
                numel *= d
            entry = GGML_TYPES.get(ggml_type)
            if entry is None:
                try:  # a type the table above lacks but the core knows
                    dt = _core.dtype_from_ggml_type(ggml_type)
                    entry = (dt.name, dt.block_size, dt.type_size)
                except TypeError:
                    entry = None  # unknown type: reported when the tensor is used
            nbytes = 0
            if entry is not None:
                _, block, type_size = entry
                if shape and shape[-1] % block:
                    raise GGUFError(f"{self.path}: tensor {name!r} of type {entry[0]} and shape {list(shape)} has "
                                    f"rows of {shape[-1]} elements, not a whole number of {block}-element blocks")
                nbytes = numel // block * type_size
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: invalid general.alignment {self.alignment}")
        self.data_offset = (self._pos + self.alignment - 1) // self.alignment * self.alignment
        for info in self.tensors.values():
            if info.offset % self.alignment:
                raise GGUFError(f"{self.path}: tensor {info.name!r} data offset {info.offset} is not aligned to "
                                f"{self.alignment} bytes (corrupt GGUF)")
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

    def dtype(self, name: str):
        """The tallow DType of tensor `name`; GGUFError naming the type when tallow lacks it."""
        from tallow import _core

        info = self._info(name)
        try:
            return _core.dtype_from_ggml_type(info.ggml_type)
        except TypeError:
            raise GGUFError(f"{self.path}: tensor {name!r} has GGUF type {info.type_name} (id {info.ggml_type}), "
                            "which tallow does not support (it computes with F32, F16, BF16, Q4_0 ... Q8_0, "
                            "Q2_K ... Q6_K, IQ4_NL and IQ4_XS); requantize the file to one of those") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array over the map (no copy), shaped
        [*shape[:-1], bytes per row] so that rows (and whole quantization blocks) can be indexed."""
        info = self._info(name)
        if info.nbytes == 0 and info.ggml_type not in GGML_TYPES:
            self.dtype(name)  # raises: unknown type
        start = self.data_offset + info.offset
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=start)
        if len(info.shape) >= 1:
            rows = info.shape[:-1]
            n_rows = 1
            for d in rows:
                n_rows *= d
            raw = raw.reshape(*rows, info.nbytes // n_rows if n_rows else 0)
        return raw

    def tensor(self, name: str):
        """Zero-copy tallow tensor over the mapped bytes (the map stays open while it lives)."""
        from tallow import _core

        info = self._info(name)
        dt = self.dtype(name)
        start = self.data_offset + info.offset
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=start)
        return _core.from_buffer(raw, dt, list(info.shape))

    def _info(self, name: str) -> GGUFTensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        if self._buf is None:
            raise GGUFError(f"{self.path}: file is closed")
        return info

    def close(self) -> None:
        """Drop this reader's references; the map closes once no tensor uses it."""
        self._buf = None  # tensors keep their own numpy views of the map alive

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={self.architecture}, tensors={len(self.tensors)}, kv={len(self.metadata)})"
