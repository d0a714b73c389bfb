"""A worker: one device's side of the engine. It loads the model (tallow.models.load_model), sizes
the KV cache from the memory left (profiled, not guessed), allocates it, captures the decode graphs,
and runs steps through its ModelRunner. Everything it takes and returns is plain data
(engine/step_data.py), so it may run in the engine's process (today: engine/executor.py) or in its
own (tests/python/engine/test_engine_step_data.py runs one in a spawned process)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np

import tallow
from tallow.engine.step_data import EmbedData, StepData
from tallow.worker.model_runner import LaunchedStep, ModelRunner

log = logging.getLogger("tallow.worker")

DEFAULT_CPU_KV_MB = 2048


@dataclasses.dataclass
class WorkerConfig:
    """How to build a worker (plain data but for the model config and source, which a worker in
    another process rebuilds from the same engine arguments: engine/executor.py load_source)."""

    dtype: str  # the model's compute dtype, resolved ("float32", "bfloat16", ...)
    kv_dtype: str
    device: str
    load_format: str = "auto"
    quantization: Optional[str] = None  # --isq type (in-situ quantization while loading)
    seed: int = 0
    max_positions: int = 0  # positions the model's rotary tables cover
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_tokens: int = 8192
    max_model_len: int = 4096
    eos_ids: tuple = ()
    overlap_depth: int = 1
    step_timing: bool = False
    num_threads: Optional[int] = None
    tp_rank: int = 0  # this worker's rank and the tensor-parallel size (tallow/parallel)
    tp_size: int = 1


class Worker:
    def __init__(self, cfg, source, wc: WorkerConfig):
        from tallow.models import load_model

        if wc.num_threads:
            tallow.set_num_threads(wc.num_threads)
        self.wc, self.cfg, self.device = wc, cfg, wc.device
        self.dtype = tallow._core.dtype(wc.dtype)
        self.kv_dtype = tallow._core.dtype(wc.kv_dtype)
        # Weights: each checkpoint tensor goes from the mmap to the model's device as it is, and the model
        # is built there (fusing, casting, dequantizing); dummy weights (load_format="dummy": random
        # values of the checkpoint's shapes) are made on the device.
        self.model = load_model(cfg, source, self.dtype, wc.device, load_format=wc.load_format, seed=wc.seed,
                                max_positions=wc.max_positions, isq=wc.quantization, tp_rank=wc.tp_rank,
                                tp_size=wc.tp_size)
        from tallow.models import weight_memory_line

        log.info(weight_memory_line(self.model, wc.device))
        self.runner = ModelRunner(self.model, wc.block_size, self.kv_dtype, wc.device, max_num_seqs=wc.max_num_seqs,
                                  max_num_tokens=wc.max_num_tokens, max_model_len=wc.max_model_len,
                                  eos_ids=wc.eos_ids, overlap_depth=wc.overlap_depth, step_timing=wc.step_timing)

    # -- KV cache ---------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return ModelRunner.kv_bytes_per_block(self.cfg, self.wc.block_size, self.kv_dtype, self.wc.tp_size)

    def kv_budget_bytes(self, mem_mb: Optional[int], gpu_memory_fraction: float, graph_bs: int) -> int:
        """Bytes for the KV cache: mem_mb when given; on the CPU DEFAULT_CPU_KV_MB; on a GPU
        gpu_memory_fraction of the memory free now (weights loaded), less the peak of the largest
        step and of the decode graphs (profiled, not guessed)."""
        if mem_mb:
            return mem_mb * 2**20
        if self.device == "cpu":
            return DEFAULT_CPU_KV_MB * 2**20
        from tallow import cuda

        wc, r = self.wc, self.runner
        free, _total = cuda.mem_get_info(self.device)
        step_peak = r.profile_peak_bytes(r.profile_lens(wc.max_num_tokens, min(wc.max_model_len, wc.max_num_tokens)))
        graph_peak = r.profile_peak_bytes([1] * graph_bs) if graph_bs else 0
        budget = int(free * gpu_memory_fraction) - step_peak - graph_peak
        log.info("GPU memory: %.2f GiB free after weights; step peak %.2f GiB, decode graphs %.2f GiB; "
                 "KV cache %.2f GiB", free / 2**30, step_peak / 2**30, graph_peak / 2**30, budget / 2**30)
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {free / 2**30:.2f} GiB free after the weights, "
                             f"a {wc.max_num_tokens}-token step needs {step_peak / 2**30:.2f} GiB; lower "
                             "--max-num-batched-tokens or raise --gpu-memory-fraction")
        return budget

    def initialize_cache(self, num_blocks: int, graph_bs: int) -> None:
        """Allocate the KV cache; capture the decode graphs up to graph_bs sequences (0: none)."""
        self.runner.allocate_kv_cache(num_blocks)
        if graph_bs:
            self.runner.capture_graphs(graph_bs)

    # -- steps ------------------------------------------------------------------------------------
    def execute_model(self, step: StepData, mask_fn=None) -> LaunchedStep:
        return self.runner.execute_model(step, mask_fn)

    def release(self, req_ids: list[str]) -> None:
        self.runner.drop_requests(req_ids)

    def embed(self, data: EmbedData) -> np.ndarray:
        return self.runner.embed(data)
