"""Engine arguments: the same names for `LLM(...)` keyword arguments and `tallow serve` flags."""
from __future__ import annotations

import dataclasses
from typing import Optional

# dtype names other servers take, mapped onto tallow's: candle-vllm's bf16 / f16 / f32, vLLM's half / float
DTYPE_ALIASES = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32", "float": "float32"}
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclasses.dataclass
class EngineArgs:
    model: Optional[str] = None  # hub id, local folder or .gguf path (--m)
    weights_dir: Optional[str] = None  # --w
    gguf_file: Optional[str] = None  # --f
    revision: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (or an alias in DTYPE_ALIASES: bf16, half, ...)
    device: str = "cpu"
    block_size: int = 16
    mem: Optional[int] = None  # KV-cache budget in MB (default: 2048 MB on CPU)
    num_kv_blocks: Optional[int] = None  # exact KV-cache size in blocks (overrides mem; tests, tuning)
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None
    # None: the device's default, filled in by default_batching() below (explicit values win)
    max_num_batched_tokens: Optional[int] = None  # token budget of one step
    prefill_chunk_size: Optional[int] = None  # chunked prefill size; 0 computes a prompt in one step
    prefix_cache: bool = True
    prefix_cache_max_tokens: Optional[int] = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | float8_e4m3 (alias fp8; CUDA only)
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    cuda_graph_max_bs: Optional[int] = None  # largest decode batch captured (default: max_num_seqs)
    async_scheduling: Optional[bool] = None  # overlap host work with the GPU (None: on for CUDA devices)
    load_format: str = "auto"  # auto | dummy (random weights of the checkpoint's shapes, made on the device)
    quantization: Optional[str] = None  # --isq: quantize float weights to this GGUF type while loading (q4k, ...)
    chat_template: Optional[str] = None
    yarn_scaling_factor: Optional[float] = None
    num_threads: Optional[int] = None
    tensor_parallel_size: int = 1  # ranks the model is sharded over (CPU: worker processes; -tp N)
    # the GPUs of the ranks (`--d 0,1`); None: tensor_parallel_size GPUs from the device's index on
    device_ids: Optional[tuple] = None
    seed: Optional[int] = None  # default seed for requests that set none (None: fresh entropy)
    max_gen_tokens: Optional[int] = None  # default max_tokens when a request sets none
    # server-wide sampling defaults (`tallow serve --temperature ...`, as candle-vllm's): a request's own value
    # wins; they win over the model's generation_config.json (engine/input_processor.py)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    generation_config: str = "auto"  # auto: sampling defaults from the model's generation_config.json; vllm: none

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid engine argument: {msg}")

        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            bad(f"block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            bad(f"tensor_parallel_size must be a positive whole number, got {self.tensor_parallel_size!r}")
        if self.device_ids is not None:
            ids = self.device_ids = tuple(self.device_ids)
            if not ids or not all(isinstance(i, int) and i >= 0 for i in ids) or len(set(ids)) != len(ids):
                bad(f"device_ids must be distinct GPU indices, got {ids!r}")
            if self.tensor_parallel_size == 1:
                self.tensor_parallel_size = len(ids)
            elif self.tensor_parallel_size != len(ids):
                bad(f"tensor_parallel_size {self.tensor_parallel_size} with {len(ids)} device ids {list(ids)}")
            dev = str(self.device)
            if dev.startswith("cuda:") and dev != f"cuda:{ids[0]}":
                bad(f"device {dev} is not the first of device_ids {list(ids)} (rank 0's GPU)")
            self.device = f"cuda:{ids[0]}"  # device ids are GPUs
        if self.max_num_seqs <= 0:
            bad(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.mem is not None and self.mem <= 0:
            bad(f"mem must be a positive number of MB, got {self.mem}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            bad(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.generation_config not in ("auto", "vllm"):
            bad(f"generation_config must be auto or vllm, got {self.generation_config!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            bad(f"max_model_len must be positive, got {self.max_model_len}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 0:
            bad(f"prefill_chunk_size must be >= 0, got {self.prefill_chunk_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            bad(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        self.prefill_chunk_size, self.max_num_batched_tokens = default_batching(
            self.device, self.prefill_chunk_size, self.max_num_batched_tokens, self.max_num_seqs)
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype.lower(), self.dtype.lower())
        if self.dtype not in DTYPES:
            bad(f"dtype must be auto, float32, float16 or bfloat16 (or {', '.join(DTYPE_ALIASES)}), got {self.dtype!r}")
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):  # vLLM's names
            self.kv_cache_dtype = "float8_e4m3"
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16", "float8_e4m3"):
            bad(f"kv_cache_dtype must be auto, float16, bfloat16, float32 or fp8 (float8_e4m3), got {self.kv_cache_dtype!r}")
        defaults = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                                                  "presence_penalty") if getattr(self, k) is not None}
        if defaults:  # server-wide sampling defaults must be valid request values
            from tallow.engine.sampling_params import SamplingParams

            try:
                SamplingParams(**defaults)
            except (TypeError, ValueError) as e:
                bad(f"sampling default: {str(e).replace('invalid sampling parameter: ', '')}")
        if self.load_format not in ("auto", "dummy"):
            bad(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization is not None:
            from tallow.layers.quantization.isq import isq_scheme

            isq_scheme(self.quantization)  # ValueError naming the valid types
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            bad(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if not (self.model or self.weights_dir or self.gguf_file):
            bad("no model given (model / --m, --w DIR or --f FILE)")


# The prefill chunk and the step's token budget by device: one place decides both (args.device is known
# here; the executor and the scheduler read the resolved fields). A step holds the running decodes and
# prefill chunks, and every stream waits a whole step between two tokens. On a GPU a step of 8,192
# tokens is short. On the CPU it is not: the step's time grows with its tokens while the prefill rate
# hardly does, so the chunk only decides how long the other streams freeze. CPU_PREFILL_CHUNK is the
# smallest chunk of {128, 256, 512, 1024, 8192} whose prefill rate is within 10% of the 8,192-token
# chunk's, measured with the demo model (SmolLM2-135M Q4_1), 4 decode streams beside one 4,000-token
# prompt, on a 2-core VM shared with other work (noisy; all runs in benchmarks/results/cpu_prefill_chunk.json):
#     python benchmarks/cpu_prefill_chunk.py --num-threads 1 --out benchmarks/results/cpu_prefill_chunk.json
# chunk 128 / 256 / 512 / 1024 / 8192: prefill 25.4 / 26.2 / 24.9 / 25.4 / 22.7 tok/s, the decode streams'
# longest gap 9.6 / 18.0 / 39.8 / 68.6 / 176 s (one thread at a load average of ~5; 128 repeated: 21.5 and
# 24.1 tok/s, gaps 15.4 and 7.8 s). The rate is flat, so the smallest chunk, 128, is chosen.
# The CPU budget shrinks with the chunk (the old 8,192 let several waiting prompts each add a chunk to one
# step) but holds max_num_seqs decodes, so no running stream is left out of a step by the others.
GPU_PREFILL_CHUNK = 8192
CPU_PREFILL_CHUNK = 128
UNCHUNKED_BUDGET = 8192  # prefill_chunk_size=0: a step must hold a whole prompt


def default_batching(device: str, prefill_chunk_size: Optional[int], max_num_batched_tokens: Optional[int],
                     max_num_seqs: int = 256) -> tuple[int, int]:
    """(prefill chunk, token budget of one step) on `device` ("cpu", "cuda", "cuda:1"); a value the
    user gave is kept, a None gets the device's default. A default budget is never below the chunk."""
    chunk = prefill_chunk_size
    if str(device).split(":")[0].strip().lower() != "cpu":
        chunk = GPU_PREFILL_CHUNK if chunk is None else chunk
        return chunk, max_num_batched_tokens or max(GPU_PREFILL_CHUNK, chunk)
    chunk = CPU_PREFILL_CHUNK if chunk is None else chunk
    if max_num_batched_tokens is not None:
        return chunk, max_num_batched_tokens
    if chunk == 0:
        return chunk, UNCHUNKED_BUDGET
    return chunk, max(CPU_PREFILL_CHUNK, chunk, max_num_seqs)


def tp_device_ids(args: "EngineArgs") -> list[int]:
    """The CUDA device index of each tensor-parallel rank: args.device_ids, else tensor_parallel_size
    consecutive GPUs from the device's index (vLLM's -tp N: the first N visible GPUs)."""
    if args.device_ids is not None:
        return list(args.device_ids)
    dev = str(args.device or "cuda")
    first = int(dev.split(":", 1)[1]) if ":" in dev else 0
    return list(range(first, first + args.tensor_parallel_size))
