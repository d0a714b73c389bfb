# Type stub of tallow._core, generated from a CPU build by tools/gen_core_stub.py (pybind11-stubgen):
# regenerate it after changing the bindings, never edit it by hand.
"""
tallow's C++ core: tensors and ops
"""
from __future__ import annotations
import builtins
import collections.abc
import numpy
import typing
import typing_extensions
class DType:
    """
    Element type of a Tensor
    
    Members:
    
      float32
    
      float16
    
      bfloat16
    
      float8_e4m3
    
      int8
    
      uint8
    
      int32
    
      int64
    
      bool
    
      q4_0
    
      q4_1
    
      q5_0
    
      q5_1
    
      q8_0
    
      q8_1
    
      q2_k
    
      q3_k
    
      q4_k
    
      q5_k
    
      q6_k
    
      q8_k
    
      iq4_nl
    
      iq4_xs
    """
    __members__: typing.ClassVar[dict[str, DType]]
    bfloat16: typing.ClassVar[DType]
    bool: typing.ClassVar[DType]
    float16: typing.ClassVar[DType]
    float32: typing.ClassVar[DType]
    float8_e4m3: typing.ClassVar[DType]
    int32: typing.ClassVar[DType]
    int64: typing.ClassVar[DType]
    int8: typing.ClassVar[DType]
    iq4_nl: typing.ClassVar[DType]
    iq4_xs: typing.ClassVar[DType]
    q2_k: typing.ClassVar[DType]
    q3_k: typing.ClassVar[DType]
    q4_0: typing.ClassVar[DType]
    q4_1: typing.ClassVar[DType]
    q4_k: typing.ClassVar[DType]
    q5_0: typing.ClassVar[DType]
    q5_1: typing.ClassVar[DType]
    q5_k: typing.ClassVar[DType]
    q6_k: typing.ClassVar[DType]
    q8_0: typing.ClassVar[DType]
    q8_1: typing.ClassVar[DType]
    q8_k: typing.ClassVar[DType]
    uint8: typing.ClassVar[DType]
    @typing.overload
    def __eq__(self, other: DType) -> builtins.bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> builtins.bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: DType) -> builtins.bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> builtins.bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    def nbytes(self, numel: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    @property
    def block_size(self) -> int:
        ...
    @property
    def ggml_type(self) -> int:
        ...
    @property
    def is_block(self) -> builtins.bool:
        ...
    @property
    def is_float(self) -> builtins.bool:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def type_size(self) -> int:
        ...
    @property
    def value(self) -> int:
        ...
class Device:
    def __eq__(self, arg0: typing.Any) -> builtins.bool:
        ...
    def __hash__(self) -> int:
        ...
    def __init__(self, spec: str) -> None:
        ...
    def __repr__(self) -> str:
        ...
    def __str__(self) -> str:
        ...
    @property
    def index(self) -> int:
        ...
    @property
    def type(self) -> str:
        ...
class Tensor:
    """
    A strided view of device memory with a dtype (see tensor)
    """
    def __add__(self, arg0: Tensor) -> Tensor:
        ...
    def __array__(self, dtype: typing.Any = None, copy: typing.Any = None) -> typing.Any:
        ...
    def __dlpack__(self, **kwargs) -> typing_extensions.CapsuleType:
        ...
    def __dlpack_device__(self) -> tuple[int, int]:
        ...
    def __getitem__(self, arg0: typing.Any) -> Tensor:
        ...
    def __init__(self, array: numpy.ndarray) -> None:
        """
        Zero-copy view of a numpy array
        """
    def __len__(self) -> int:
        ...
    @typing.overload
    def __mul__(self, arg0: Tensor) -> Tensor:
        ...
    @typing.overload
    def __mul__(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> Tensor:
        ...
    def __repr__(self) -> str:
        ...
    def __rmul__(self, arg0: typing.SupportsFloat | typing.SupportsIndex) -> Tensor:
        ...
    def as_strided(self, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], strides: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], offset: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        """
        View of the same storage with explicit shape, strides and offset (in elements)
        """
    def clone(self) -> Tensor:
        ...
    def contiguous(self) -> Tensor:
        ...
    def copy_(self, src: Tensor) -> Tensor:
        ...
    def dim(self) -> int:
        ...
    def expand(self, *args) -> Tensor:
        ...
    def is_contiguous(self) -> builtins.bool:
        ...
    def narrow(self, dim: typing.SupportsInt | typing.SupportsIndex, start: typing.SupportsInt | typing.SupportsIndex, length: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        ...
    def numel(self) -> int:
        ...
    def numpy(self, raw: builtins.bool = False) -> numpy.ndarray:
        """
        Zero-copy numpy view; raw=True shows bf16/f8/block tensors as their bytes
        """
    def permute(self, *args) -> Tensor:
        ...
    def reshape(self, *args) -> Tensor:
        ...
    def select(self, dim: typing.SupportsInt | typing.SupportsIndex, index: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        ...
    def size(self, dim: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def slice(self, dim: typing.SupportsInt | typing.SupportsIndex, start: typing.SupportsInt | typing.SupportsIndex, stop: typing.SupportsInt | typing.SupportsIndex, step: typing.SupportsInt | typing.SupportsIndex = 1) -> Tensor:
        ...
    def squeeze(self, dim: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        ...
    def stride(self, dim: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def to(self, target: typing.Any) -> Tensor:
        """
        Cast to a dtype (block dtypes dequantize) or copy to a device
        """
    def transpose(self, dim0: typing.SupportsInt | typing.SupportsIndex, dim1: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        ...
    def unsqueeze(self, dim: typing.SupportsInt | typing.SupportsIndex) -> Tensor:
        ...
    def view(self, *args) -> Tensor:
        ...
    def view_as_dtype(self, dtype: typing.Any, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> Tensor:
        ...
    @property
    def T(self) -> Tensor:
        ...
    @property
    def data_ptr(self) -> int:
        ...
    @property
    def device(self) -> Device:
        ...
    @property
    def dtype(self) -> DType:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def ndim(self) -> int:
        ...
    @property
    def offset(self) -> int:
        ...
    @property
    def shape(self) -> tuple:
        ...
    @property
    def strides(self) -> tuple:
        ...
def _cpu_isa() -> str:
    """
    The CPU kernel set in use by the GEMM and the dequantization row routines (avx512, avx2, portable)
    """
def _quant_dot_kernel() -> str:
    """
    The kernel set quant_linear's decode path uses (avx512-vnni, avx2, portable; follows _cpu_isa)
    """
def _set_cpu_isa(name: str) -> builtins.bool:
    """
    Switch the CPU kernel set (tests and comparisons); False when this CPU or build lacks it
    """
def _set_sampling_buffer_capacity(n: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Testing: the device sampling kernels' candidate buffer size (n <= 0: the default)
    """
def add(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    ...
def apply_penalties(logits: Tensor, token_ids: Tensor, token_counts: Tensor, repetition_penalty: Tensor, frequency_penalty: Tensor, presence_penalty: Tensor) -> None:
    """
    In place on logits f32 [B, V]: bans (count < 0), repetition, frequency and presence penalties for the ids listed per row in token_ids i32 [B, L] (-1: padding) with output counts token_counts i32 [B, L]
    """
def apply_token_bitmask_(logits: Tensor, bitmask: Tensor) -> None:
    """
    In place: logits [B, V] -> -inf where bit j % 32 of bitmask i32 [B, W][b, j / 32] is 0 (a grammar's next-token mask)
    """
def argmax(x: Tensor) -> Tensor:
    ...
def attention(q: Tensor, k: Tensor, v: Tensor, scale: typing.SupportsFloat | typing.SupportsIndex, causal: builtins.bool = True, sliding_window: typing.SupportsInt | typing.SupportsIndex = 0, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0) -> Tensor:
    ...
def cast(x: Tensor, dtype: typing.Any) -> Tensor:
    ...
def cpu_empty_cache() -> None:
    """
    Return the CPU allocator's cached free blocks to the system
    """
def cpu_memory_stats() -> dict:
    """
    Bytes held by tensors the CPU allocator made (reserved includes cached free blocks)
    """
def dequantize(q: Tensor, dtype: typing.Any = 'float32') -> Tensor:
    ...
def dtype(obj: typing.Any) -> DType:
    """
    DType from a name, a DType or a numpy dtype
    """
def dtype_from_ggml_type(ggml_type: typing.SupportsInt | typing.SupportsIndex) -> DType:
    ...
def embedding(ids: Tensor, table: Tensor, dtype: typing.Any = None, vocab_start: typing.SupportsInt | typing.SupportsIndex | None = None) -> Tensor:
    """
    table rows by id; vocab_start: a vocabulary slice's rows, ids outside it give zero rows
    """
def empty(shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], dtype: typing.Any = 'float32', device: typing.Any = 'cpu') -> Tensor:
    ...
def fill_from_previous_(ids: Tensor, previous: Tensor) -> None:
    """
    In place: ids[t] < 0 becomes previous[-ids[t] - 1] (tokens sampled by the previous step, still on the device)
    """
def fill_uniform_(t: Tensor, low: typing.SupportsFloat | typing.SupportsIndex = 0.0, high: typing.SupportsFloat | typing.SupportsIndex = 1.0, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> Tensor:
    """
    Fills t (float32/float16/bfloat16, contiguous, any device) in place with values uniform in [low, high] from a counter-based hash of (seed, element index): the same values on every device and thread count. Returns t
    """
def from_buffer(buffer: numpy.ndarray, dtype: typing.Any, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> Tensor:
    """
    Zero-copy Tensor of `dtype` (block types included) over the bytes of a contiguous array
    """
def from_dlpack(obj: typing.Any) -> Tensor:
    ...
def from_numpy(array: numpy.ndarray) -> Tensor:
    """
    Zero-copy Tensor over a numpy array (copies only for negative or unaligned strides)
    """
def fused_add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: typing.SupportsFloat | typing.SupportsIndex, gemma_offset: builtins.bool = False) -> Tensor:
    """
    residual += x in place; returns rms_norm(residual)
    """
def gated_linear(x: Tensor, w: Tensor, bias: Tensor | None = None, activation: str = 'silu', out: Tensor | None = None) -> Tensor:
    """
    linear(act(x[..., :K]) * x[..., K:], w, bias) for x [..., 2K], w [N, K]; activation 'silu', 'gelu_tanh' or 'gelu' (erf). The product is rounded to x's dtype first, as silu_and_mul rounds it
    """
def gelu_and_mul(x: Tensor, approximate: str = 'tanh', out: Tensor | None = None) -> Tensor:
    ...
def get_num_threads() -> int:
    """
    Threads used by CPU kernels
    """
def kernel_tuning() -> dict:
    """
    The kernel tuning fields and their values (cpp/core/tuning.h: read from TALLOW_* at import)
    """
def kernel_tuning_fields() -> dict:
    """
    {field: (environment variable, what it does)}
    """
def layer_norm(x: Tensor, w: Tensor | None = None, b: Tensor | None = None, eps: typing.SupportsFloat | typing.SupportsIndex = 9.999999747378752e-06, out: Tensor | None = None) -> Tensor:
    ...
def linear(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    ...
def logprobs(logits: Tensor, token_ids: Tensor, num_top: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[Tensor, Tensor, Tensor]:
    """
    log_softmax of logits [B, V]: (values f32 [B, 1 + num_top], ids i32 [B, 1 + num_top], ranks i32 [B]); column 0 is token_ids, then the num_top most probable tokens
    """
def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    ...
def mul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    ...
def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: typing.SupportsFloat | typing.SupportsIndex, sliding_window: typing.SupportsInt | typing.SupportsIndex = 0, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0, out: Tensor | None = None, k_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0, v_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0, settled_cache: builtins.bool = False) -> Tensor:
    """
    Causal attention of q [T, Hq, D] (the last query_start_loc[b+1] - query_start_loc[b] tokens of each sequence b) over the paged KV cache; returns [T, Hq, Dv] in q's dtype. float8_e4m3 caches are read as stored * k_scale / stored * v_scale. settled_cache=True promises that no kernel still running when the call starts writes cache rows before each sequence's new tokens (true right after rope_and_cache / reshape_and_cache): the CUDA decode kernel then reads them early
    """
def quant_linear(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """
    x [..., K] @ dequantize(w [N, K])^T (+ bias [N]) -> [..., N] in x's dtype, w kept in its GGUF block format (a float w: plain linear); CPU: 8-bit quantized x and integer dots for <= 16 rows of x
    """
def quant_linear_parts(x: Tensor, parts: collections.abc.Sequence[Tensor], bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """
    x [..., K] @ [parts[0]; parts[1]; ...]^T (+ bias) -> [..., sum N_i]: quant_linear over the parts of a fused layer kept apart (block types may differ), one parallel region for all (CPU only)
    """
def quantize(x: Tensor, dtype: typing.Any) -> Tensor:
    """
    float x [..., K] -> the same shape in a GGUF block dtype (a DType or a name: q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, iq4_nl, iq4_xs) on x's device; gguf-py's / llama.cpp's reference quantizers, bit for bit, the same bytes on CPU and CUDA
    """
def reshape_and_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0, v_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0) -> None:
    """
    Writes k [T, Hk, D] / v [T, Hk, Dv] into flat slots slot_mapping[t] of the paged caches, in place (negative slots are skipped; values are converted to the caches' dtype; float8_e4m3 caches store value / k_scale and value / v_scale)
    """
def rms_norm(x: Tensor, w: Tensor, eps: typing.SupportsFloat | typing.SupportsIndex, gemma_offset: builtins.bool = False, out: Tensor | None = None) -> Tensor:
    ...
def rope_and_cache(positions: Tensor, q: Tensor, k: Tensor, v: Tensor, cos_sin_cache: Tensor, neox: builtins.bool, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, norm_eps: typing.SupportsFloat | typing.SupportsIndex = 9.999999974752427e-07, gemma_norm: builtins.bool = False, k_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0, v_scale: typing.SupportsFloat | typing.SupportsIndex = 1.0) -> None:
    """
    In place: optional per-head RMSNorm of q [T, Hq, D] and k [T, Hk, D] (weights [D]; gemma_norm: 1 + w), rotary embedding of both, and the write of k and v [T, Hk, Dv] into slots slot_mapping[t] of the paged caches (negative slots skipped; float8_e4m3 caches store value / scale). Exactly rms_norm, rotary_embedding and reshape_and_cache in order; one kernel on CUDA
    """
def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor | None, cos_sin_cache: Tensor, neox: builtins.bool = True) -> None:
    """
    Rotates q and k in place
    """
def sample_tokens(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, seeds: Tensor, offsets: Tensor) -> Tensor:
    """
    One token per row of logits [B, V] (i32 [B]): greedy below temperature 1e-5, else top-k, min-p, top-p and a seeded Gumbel-max draw keyed by (seeds[b], offsets[b])
    """
def scale(a: Tensor, s: typing.SupportsFloat | typing.SupportsIndex, out: Tensor | None = None) -> Tensor:
    ...
def set_kernel_tuning(**kwargs) -> dict:
    """
    Set kernel tuning fields by name (see kernel_tuning()); returns their previous values. Not synchronised with ops running on other threads: for tests and benchmarks, between ops
    """
def set_num_threads(n: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Set the threads used by CPU kernels (n <= 0: all cores, or TALLOW_NUM_THREADS)
    """
def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    ...
def softmax(x: Tensor, scale: typing.SupportsFloat | typing.SupportsIndex = 1.0, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0, out: Tensor | None = None) -> Tensor:
    ...
def tensor(data: typing.Any, dtype: typing.Any = None, device: typing.Any = 'cpu') -> Tensor:
    """
    New tensor (a copy) from a nested list or array; float64 becomes float32 unless dtype says otherwise
    """
def topk(x: Tensor, k: typing.SupportsInt | typing.SupportsIndex) -> tuple[Tensor, Tensor]:
    ...
bfloat16: DType
bool: DType
build_info: dict
float16: DType
float32: DType
float8_e4m3: DType
int32: DType
int64: DType
int8: DType
iq4_nl: DType
iq4_xs: DType
q2_k: DType
q3_k: DType
q4_0: DType
q4_1: DType
q4_k: DType
q5_0: DType
q5_1: DType
q5_k: DType
q6_k: DType
q8_0: DType
q8_1: DType
q8_k: DType
uint8: DType
class cuda:
    """
    CUDA runtime: devices, memory, streams, events, graphs

    At run time an attribute of tallow._core (a module made by pybind11's def_submodule, not
    importable on its own); a class here so that one stub file describes the whole extension.
    """
    @staticmethod
    def CUDAGraph(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def Event(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def Stream(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def copy_to_host_async(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def current_device(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def current_stream(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def default_stream(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def device_count() -> int:
        ...
    @staticmethod
    def empty_cache(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def empty_pinned(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def get_device_properties(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def graph_pool_handle(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def is_available() -> builtins.bool:
        ...
    @staticmethod
    def mem_get_info(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def memory_stats(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def reset_peak_memory_stats(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def set_current_stream(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def set_device(*args, **kwargs) -> typing.Any:
        ...
    @staticmethod
    def synchronize(*args, **kwargs) -> typing.Any:
        ...
    built: typing.ClassVar[builtins.bool]
