"""Engine arguments: the same names for `LLM(...)` keyword arguments and `tallow serve` flags."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class EngineArgs:
    model: Optional[str] = None  # hub id, local folder or .gguf path (--m)
    weights_dir: Optional[str] = None  # --w
    gguf_file: Optional[str] = None  # --f
    revision: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "cpu"
    block_size: int = 16
    mem: Optional[int] = None  # KV-cache budget in MB (default: 2048 MB on CPU)
    num_kv_blocks: Optional[int] = None  # exact KV-cache size in blocks (overrides mem; tests, tuning)
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    prefill_chunk_size: int = 8192
    prefix_cache: bool = True
    prefix_cache_max_tokens: Optional[int] = None
    kv_cache_dtype: str = "auto"
    chat_template: Optional[str] = None
    yarn_scaling_factor: Optional[float] = None
    num_threads: Optional[int] = None
    seed: Optional[int] = None  # default seed for requests that set none (None: fresh entropy)
    max_gen_tokens: Optional[int] = None  # default max_tokens when a request sets none
    frequency_penalty: Optional[float] = None  # server-wide sampling defaults
    presence_penalty: Optional[float] = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid engine argument: {msg}")

        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            bad(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            bad(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.mem is not None and self.mem <= 0:
            bad(f"mem must be a positive number of MB, got {self.mem}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            bad(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            bad(f"max_model_len must be positive, got {self.max_model_len}")
        if self.prefill_chunk_size < 0:
            bad(f"prefill_chunk_size must be >= 0, got {self.prefill_chunk_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            bad(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            bad(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if not (self.model or self.weights_dir or self.gguf_file):
            bad("no model given (model / --m, --w DIR or --f FILE)")
