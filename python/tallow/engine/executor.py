"""The executor: the engine core's one door to the devices. It owns the device side (the model via
tallow.models.load_model, memory profiling and the KV-cache budget, KV-cache allocation, CUDA-graph
capture) through its workers, and takes and returns plain data only (engine/step_data.py).

tensor_parallel_size 1 (the default): one worker in this process. N > 1: rank 0's worker stays in this
process (its runner samples and takes the structured-output masks) and ranks 1..N-1 run in spawned
processes (tallow/parallel/workers.py), each loading its shard; every step's StepData goes to all of
them, and the ranks meet in the forward pass's collectives (CPU: shared memory; GPUs: NCCL, not built
yet). The KV cache gets the same number of blocks on every rank: the fewest any rank's budget holds."""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

import tallow
from tallow.engine.args import EngineArgs
from tallow.engine.errors import EngineDeadError
from tallow.engine.step_data import EmbedData, StepData
from tallow.worker.worker import Worker, WorkerConfig

log = logging.getLogger("tallow.engine")


def load_source(args: EngineArgs):
    """(model config, model source) for the engine arguments (a worker in another process rebuilds
    them from the same arguments)."""
    from tallow.config import ModelConfig
    from tallow.loader.source import resolve_model_source

    dummy = args.load_format == "dummy"
    src = resolve_model_source(m=args.model, w=args.weights_dir, f=args.gguf_file, revision=args.revision,
                               config_only=dummy)
    cfg = ModelConfig.from_gguf(src.gguf) if src.kind == "gguf" else ModelConfig.from_pretrained_dir(src.model_dir)
    if args.yarn_scaling_factor:
        cfg = cfg.with_yarn_scaling(args.yarn_scaling_factor)
    return cfg, src


def check_device(device: str) -> str:
    d = str(tallow.Device(device))  # ValueError for a malformed name
    if d == "cpu":
        return d
    if not tallow._core.build_info.get("cuda"):
        raise ValueError(f"device {device!r}: this build of tallow has no CUDA backend (reinstall on a machine "
                         "with nvcc, or use device='cpu')")
    from tallow import cuda

    if not cuda.is_available() or tallow.Device(d).index >= cuda.device_count():
        raise ValueError(f"device {device!r}: no such CUDA device (visible: {cuda.device_count()})")
    return d


def resolve_dtype(name: str, cfg, device: str) -> str:
    if name != "auto":
        return name
    if device != "cpu":  # GPUs: the checkpoint's half type, bf16 for f32/GGUF checkpoints
        return "float16" if cfg.dtype == "float16" else "bfloat16"
    # CPU kernels run fastest in f32; half-precision checkpoints are widened once at load.
    return "float32"


def worker_config(args: EngineArgs, cfg, device: str, eos_ids, overlap_depth: int, step_timing: bool = False
                  ) -> WorkerConfig:
    dtype = resolve_dtype(args.dtype, cfg, device)
    max_len = args.max_model_len or cfg.max_position_embeddings
    return WorkerConfig(
        dtype=dtype, kv_dtype=dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype, device=device,
        load_format=args.load_format, quantization=args.quantization, seed=args.seed or 0,
        max_positions=max(args.max_model_len or 0, cfg.max_position_embeddings), block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_tokens=max_batched_tokens(args), max_model_len=max_len,
        eos_ids=tuple(sorted(eos_ids)), overlap_depth=overlap_depth, step_timing=step_timing,
        num_threads=args.num_threads)


def max_batched_tokens(args: EngineArgs) -> int:
    """The token budget of one step (the device's default is resolved in args.default_batching)."""
    return args.max_num_batched_tokens


def graph_batch_size(args: EngineArgs, device: str) -> int:
    """The largest decode batch captured in a CUDA graph (0: none)."""
    if device == "cpu" or args.enforce_eager:
        return 0
    cap = args.cuda_graph_max_bs if args.cuda_graph_max_bs is not None else args.max_num_seqs
    return min(cap, args.max_num_seqs)


def check_tensor_parallel(cfg, tp: int, device: str, device_ids=None) -> None:
    """One clear line for a tensor-parallel size this model or these devices cannot take."""
    if tp == 1:
        return
    if device != "cpu":
        from tallow import cuda

        have = cuda.device_count()
        missing = [i for i in device_ids or () if i >= have]
        if missing:
            raise ValueError(f"tensor_parallel_size {tp} needs GPUs {list(device_ids)}, but {have} "
                             f"{'is' if have == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES counts)")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv} key-value heads: one must divide the other")


def tp_slot_bytes(args: EngineArgs, cfg, tp: int) -> int:
    """The shared-memory slot of one rank: the largest message of a step in f32 (the hidden states of
    a full step, or one rank's logits of max_num_seqs rows), capped (larger ones go in rounds)."""
    largest = max(max_batched_tokens(args) * cfg.hidden_size, args.max_num_seqs * -(-cfg.vocab_size // tp)) * 4
    return min(largest, 16 * 2**20)


class _GuardedStep:
    """A tensor-parallel step in flight: on GPUs its collectives complete where its results are read, so
    a rank that died or got stuck surfaces there (CollectiveError), and ends the engine like a failure
    at launch does."""

    __slots__ = ("_executor", "_launched")

    def __init__(self, executor: "Executor", launched):
        self._executor, self._launched = executor, launched

    def result(self):
        from tallow.parallel.communicator import CollectiveError

        try:
            return self._launched.result()
        except CollectiveError as e:
            self._executor._fail(e)


class Executor:
    def __init__(self, args: EngineArgs, cfg, source, device: str, eos_ids, overlap_depth: int,
                 step_timing: bool = False):
        wc = worker_config(args, cfg, device, eos_ids, overlap_depth, step_timing)
        tp = args.tensor_parallel_size
        self.tp_size, self.workers, self._dead = tp, None, None
        if tp > 1:
            from tallow import envs
            from tallow.engine.args import tp_device_ids
            from tallow.parallel import set_tp_group
            from tallow.parallel.mpi import MpiWorkerGroup, mpi_world
            from tallow.parallel.workers import WorkerGroup

            world = mpi_world()  # under mpirun the other ranks run on their own hosts, one GPU each
            device_ids = None if device == "cpu" or world is not None else tp_device_ids(args)
            check_tensor_parallel(cfg, tp, device, device_ids)
            if world is not None:
                threads = args.num_threads
                wc = dataclasses.replace(wc, tp_rank=0, tp_size=tp)
                self.workers = MpiWorkerGroup(tp, args, cfg, device, eos_ids, overlap_depth, threads,
                                              envs.TALLOW_TP_TIMEOUT_S)
            else:
                # The ranks share the cores: each gets its part unless --num-threads says otherwise.
                threads = args.num_threads or max(1, (os.cpu_count() or 1) // tp)
                wc = dataclasses.replace(wc, tp_rank=0, tp_size=tp, num_threads=threads)
                self.workers = WorkerGroup(tp, args, cfg, device, eos_ids, overlap_depth, threads,
                                           tp_slot_bytes(args, cfg, tp), envs.TALLOW_TP_TIMEOUT_S, device_ids)
            set_tp_group(self.workers.comm)
        try:
            self._build(args, cfg, source, device, wc)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, args: EngineArgs, cfg, source, device: str, wc) -> None:
        self.worker = Worker(cfg, source, wc)
        self.dtype = self.worker.dtype
        bs = args.block_size
        if args.max_model_len and args.max_model_len > cfg.max_position_embeddings and not args.yarn_scaling_factor:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context "
                             f"({cfg.max_position_embeddings}); use --yarn-scaling-factor to extend it")
        max_len = wc.max_model_len

        # KV cache: sized from the budget (--mem MB; on a GPU by default gpu_memory_fraction of the
        # memory free after the weights, less the peak of the largest step and the decode graphs'
        # memory); it must hold at least one max-length sequence.
        per_block = self.worker.kv_bytes_per_block()
        graph_bs = graph_batch_size(args, device)
        budget = self.worker.kv_budget_bytes(args.mem, args.gpu_memory_fraction, graph_bs)
        num_blocks = budget // per_block
        if self.workers is not None:  # every rank the same block count: the fewest any rank holds
            for pb, b in self.workers.wait_ready():
                if b // pb < num_blocks:
                    num_blocks, budget, per_block = b // pb, b, pb
        num_blocks = args.num_kv_blocks or num_blocks
        capacity = num_blocks * bs
        if capacity < max_len:
            if args.max_model_len:
                raise ValueError(
                    f"the KV cache ({budget // 2**20} MB = {capacity} tokens at "
                    f"{per_block // bs} bytes/token) cannot hold one sequence of max_model_len={max_len}; "
                    f"raise --mem to at least {-(-max_len * per_block // bs // 2**20)} MB or lower --max-model-len")
            max_len = capacity // bs * bs
            if max_len < bs:
                raise ValueError(f"the KV cache budget ({budget // 2**20} MB) holds less than one block of {bs} "
                                 f"tokens ({per_block} bytes); raise --mem")
            log.warning("max_model_len lowered to %d tokens to fit the KV cache (raise --mem for more)", max_len)
        self.num_blocks, self.max_model_len = num_blocks, max_len
        if self.workers is not None:
            self.workers.send("cache", num_blocks)
        self.worker.initialize_cache(num_blocks, graph_bs)

    @property
    def runner(self):
        """The in-process worker's model runner (tests and benchmarks look inside it)."""
        return self.worker.runner

    def execute_model(self, step: StepData, mask_fn=None):
        """Queue one step; the returned handle's result() gives its StepOutput (reading it back).
        mask_fn: called once the forward pass is queued, returns the sampled rows' grammar bitmask
        (structured output) or None."""
        if self.workers is None:
            return self.worker.execute_model(step, mask_fn)
        return _GuardedStep(self, self._on_all_ranks("step", step, lambda: self.worker.execute_model(step, mask_fn)))

    def release(self, req_ids: list[str]) -> None:
        """Drop the workers' state of finished requests outside a step (the engine is idle)."""
        if self.workers is not None:
            self._on_all_ranks("release", list(req_ids), lambda: None)
        self.worker.release(req_ids)

    def embed(self, data: EmbedData) -> np.ndarray:
        if self.workers is None:
            return self.worker.embed(data)
        return self._on_all_ranks("embed", data, lambda: self.worker.embed(data))

    def set_eos_ids(self, eos_ids) -> None:
        if self.workers is not None:
            self._on_all_ranks("eos", sorted(eos_ids), lambda: None)
        self.worker.runner.eos_ids = set(eos_ids)

    def _on_all_ranks(self, cmd: str, payload, run_here):
        """Send a command to the workers, then run rank 0's share. A rank that failed or died ends the
        engine: the workers are stopped and EngineDeadError raised (now and for every later call)."""
        from tallow.parallel.communicator import CollectiveError

        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            self.workers.send(cmd, payload)
            return run_here()
        except CollectiveError as e:
            self._fail(e)

    def _fail(self, e: BaseException):
        """A rank failed or died: stop the workers; EngineDeadError now and for every later call."""
        self._dead = f"tensor parallelism stopped: {self.workers.why_gone() or e}"
        log.error("%s", self._dead)
        self.shutdown()
        raise EngineDeadError(self._dead) from None

    def shutdown(self) -> None:
        if self.workers is not None:
            from tallow.parallel.communicator import clear_tp_group

            self.workers.shutdown()
            clear_tp_group(self.workers.comm)
