"""Command-line flags shared by `tallow serve`, `tallow generate` and `tallow chat`, mapped onto
EngineArgs (the same names `LLM(...)` takes). Flags follow candle-vllm / vLLM users' habits: their names for
the same setting are aliases (--kvcache-mem-gpu = --mem, --gpu-memory-utilization = --gpu-memory-fraction,
--enable-prefix-caching = --prefix-cache, --kv-cache-dtype fp8 = --fp8-kvcache, --dtype bf16 = bfloat16)."""
from __future__ import annotations

import argparse

from tallow.engine.args import DTYPE_ALIASES, DTYPES, EngineArgs


def dtype_name(value: str) -> str:
    """--dtype's value with candle-vllm's and vLLM's aliases mapped onto tallow's names (argparse then
    checks it against the choices)."""
    return DTYPE_ALIASES.get(value.lower(), value.lower())


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """positional_model=False leaves the positional arguments to the command (`tallow generate`
    takes prompts there); the model is then given with --m / --w / --f."""
    g = p.add_argument_group("model")
    if positional_model:
        g.add_argument("model_pos", nargs="?", metavar="MODEL",
                       help="hub id (org/name), local folder or .gguf file (same as --m)")
    g.add_argument("--m", "--model", dest="model", help="Hugging Face hub id (org/name) or local path")
    g.add_argument("--w", "--weights", dest="weights_dir", help="local folder with config.json and safetensors")
    g.add_argument("--f", "--gguf", dest="gguf_file",
                   help="a .gguf file, or with --m a GGUF repository, the file to pick inside it")
    g.add_argument("--revision", help="hub revision (branch, tag or commit)")
    g.add_argument("--dtype", default="auto", type=dtype_name, choices=DTYPES,
                   help="compute dtype (auto: float32 on CPU); also bf16, f16, f32 (candle-vllm), half, float (vLLM)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes (benchmarks; needs only config.json)")
    g.add_argument("--isq", metavar="TYPE",
                   help="quantize float (safetensors or dummy) weights to a GGUF type while loading, on the device: "
                        "q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k")
    g.add_argument("--chat-template", help="chat template file or inline Jinja, overriding the model's")
    g.add_argument("--yarn-scaling-factor", type=float, help="extend the context with YaRN by this factor")

    g = p.add_argument_group("device and memory")
    g.add_argument("--d", "--device-ids", dest="device_ids",
                   help="GPU ids, e.g. 0, or 0,1 for tensor parallelism over both (default: CPU)")
    g.add_argument("-tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=None, metavar="N",
                   help="shard the model over N ranks: the first N GPUs (or N from --d's GPU on), NCCL between "
                        "them; without a GPU, N worker processes sharing the cores, a shared-memory all-reduce")
    g.add_argument("--mem", "--kvcache-mem-gpu", dest="mem", type=int, metavar="MB",
                   help="KV-cache budget in MB (default 2048 on CPU; on a GPU it replaces --gpu-memory-fraction)")
    g.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", dest="gpu_memory_fraction", type=float,
                   default=0.9, metavar="F",
                   help="fraction of the GPU memory free after loading the weights to give the KV cache "
                        "(default 0.9; vLLM's --gpu-memory-utilization counts the weights too)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--fp8-kvcache", action="store_true", help="store the KV cache in FP8 E4M3 (CUDA only)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None,
                   help="vLLM's name for the KV-cache dtype: auto (the model's), fp8 / fp8_e4m3 (= --fp8-kvcache)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int,
                   help="largest decode batch captured in a CUDA graph (default: --max-num-seqs)")
    g.add_argument("--num-threads", type=int, help="CPU threads for the kernels (default: all cores)")

    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's, or what fits the cache)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget of one step (default: the prefill chunk, at least 8192 on a GPU)")
    g.add_argument("--prefill-chunk-size", type=int,
                   help="chunked prefill size; 0 disables chunking (default 8192 on a GPU, smaller on the CPU so a "
                        "long prompt does not stall the other streams)")
    g.add_argument("--prefix-cache", "--enable-prefix-caching", dest="prefix_cache",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on)")
    g.add_argument("--prefix-cache-max-tokens", type=int, help="most tokens kept cached in free blocks")

    g = p.add_argument_group("sampling defaults")
    g.add_argument("--max-gen-tokens", type=int, help="default max_tokens of a request that sets none")
    g.add_argument("--frequency-penalty", type=float, help="default frequency penalty")
    g.add_argument("--presence-penalty", type=float, help="default presence penalty")
    g.add_argument("--seed", type=int, help="default sampling seed")
    g.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto (default): temperature, top_p, top_k, min_p and repetition_penalty from the model's "
                        "generation_config.json are the defaults a request overrides; vllm: ignore the file")


def add_sampling_default_args(p: argparse.ArgumentParser) -> None:
    """`tallow serve`'s server-wide sampling defaults, as candle-vllm's flags: a request's own value wins,
    an unset one takes these, then the model's generation_config.json, then the usual default.
    (--frequency-penalty and --presence-penalty are in add_engine_args; `tallow generate` has its own
    per-run --temperature etc., so these use other dest names.)"""
    g = p.add_argument_group("server-wide sampling defaults (a request's own value wins)")
    g.add_argument("--temperature", dest="default_temperature", type=float, metavar="T",
                   help="default temperature (0: greedy)")
    g.add_argument("--top-p", dest="default_top_p", type=float, metavar="P", help="default top_p")
    g.add_argument("--top-k", dest="default_top_k", type=int, metavar="K", help="default top_k (-1: off)")
    g.add_argument("--min-p", dest="default_min_p", type=float, metavar="P", help="default min_p")


class FlagError(ValueError):
    """A flag this build cannot honour; the CLI prints it as one line."""


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    model_pos = getattr(ns, "model_pos", None)
    model = ns.model or model_pos
    if ns.model and model_pos:
        raise FlagError(f"give the model once (got {model_pos!r} and --m {ns.model!r})")
    gguf = ns.gguf_file
    if model and model.endswith(".gguf") and not gguf:
        model, gguf = None, model
    if ns.isq:
        from tallow.layers.quantization.isq import isq_scheme

        try:
            isq_scheme(ns.isq)
        except ValueError as e:
            raise FlagError(str(e)) from None
    device = "cpu"
    tp = getattr(ns, "tensor_parallel_size", None)
    if tp is not None and tp < 1:
        raise FlagError(f"--tensor-parallel-size must be at least 1, got {tp}")
    device_ids = None
    if ns.device_ids:
        try:
            device_ids = tuple(int(s) for s in ns.device_ids.split(",") if s.strip())
        except ValueError:
            raise FlagError(f"--d {ns.device_ids}: expected GPU indices separated by commas, e.g. --d 0,1") from None
        if not device_ids or min(device_ids) < 0 or len(set(device_ids)) != len(device_ids):
            raise FlagError(f"--d {ns.device_ids}: expected distinct GPU indices, e.g. --d 0,1")
        device = f"cuda:{device_ids[0]}"
        if tp is not None and tp != len(device_ids):
            if len(device_ids) != 1:
                raise FlagError(f"--d {ns.device_ids} names {len(device_ids)} GPUs but --tensor-parallel-size is {tp}")
            device_ids = None  # --d N -tp M: M GPUs from N on
        elif len(device_ids) == 1:
            device_ids = None
    elif tp is not None and tp > 1:
        import tallow.cuda

        if tallow.cuda.is_available():  # vLLM's -tp N: the first N visible GPUs
            device = "cuda:0"
    from tallow.parallel.mpi import mpi_world

    world = mpi_world()
    if world is not None:  # under mpirun: one rank a process, tensor parallelism over all of them
        if tp not in (None, world.size):
            raise FlagError(f"under an MPI runner of {world.size} ranks the tensor-parallel size is {world.size}; "
                            f"got --tensor-parallel-size {tp} (leave it out)")
        if device_ids is not None:
            raise FlagError(f"--d {ns.device_ids}: under an MPI runner each rank takes the GPU of its local rank; "
                            "give --d one id (GPUs on) or none, and CUDA_VISIBLE_DEVICES to choose them")
        tp = world.size
        if device != "cpu":
            device = f"cuda:{world.local_rank}"
    kv_dtype = getattr(ns, "kv_cache_dtype", None)
    fp8 = ns.fp8_kvcache or kv_dtype in ("fp8", "fp8_e4m3")
    if fp8 and device == "cpu":
        flag = "--fp8-kvcache" if ns.fp8_kvcache else f"--kv-cache-dtype {kv_dtype}"
        raise FlagError(f"{flag} needs a CUDA device (--d 0); the CPU backend keeps the KV cache in float")
    return EngineArgs(
        model=model, weights_dir=ns.weights_dir, gguf_file=gguf, revision=ns.revision, dtype=ns.dtype,
        device=device, block_size=ns.block_size, mem=ns.mem, gpu_memory_fraction=ns.gpu_memory_fraction,
        max_num_seqs=ns.max_num_seqs, max_model_len=ns.max_model_len, max_num_batched_tokens=ns.max_num_batched_tokens,
        prefill_chunk_size=ns.prefill_chunk_size, prefix_cache=ns.prefix_cache,
        prefix_cache_max_tokens=ns.prefix_cache_max_tokens, kv_cache_dtype="float8_e4m3" if fp8 else "auto",
        chat_template=ns.chat_template, yarn_scaling_factor=ns.yarn_scaling_factor, num_threads=ns.num_threads,
        seed=ns.seed, max_gen_tokens=ns.max_gen_tokens, frequency_penalty=ns.frequency_penalty,
        presence_penalty=ns.presence_penalty, generation_config=ns.generation_config, enforce_eager=ns.enforce_eager,
        # `tallow serve`'s server-wide defaults (add_sampling_default_args); other commands have none
        temperature=getattr(ns, "default_temperature", None), top_p=getattr(ns, "default_top_p", None),
        top_k=getattr(ns, "default_top_k", None), min_p=getattr(ns, "default_min_p", None),
        cuda_graph_max_bs=ns.cuda_graph_max_bs, load_format=ns.load_format, quantization=ns.isq,
        tensor_parallel_size=tp or (len(device_ids) if device_ids else 1), device_ids=device_ids)
