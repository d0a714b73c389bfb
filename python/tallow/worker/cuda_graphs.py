"""CUDA graphs for decode steps: one graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to the
largest captured size), all sharing one memory pool (captured largest first, so smaller graphs reuse
the larger ones' intermediates). A decode step of B sequences replays the smallest bucket >= B with
the batch padded by dummy one-token sequences; anything else (prefill, mixed, bigger batches) runs
eagerly. Inputs are the static StepInputs buffers; each graph's logits tensor is its output."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import tallow
from tallow import cuda

log = logging.getLogger("tallow.worker")


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (max_bs itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if max_bs > 0 and (not sizes or sizes[-1] != max_bs):
        sizes.append(max_bs)
    return sorted(set(s for s in sizes if s <= max_bs))


class DecodeGraphs:
    def __init__(self, device: str, stream):
        self.device = device
        self.stream = stream
        self.pool = None
        self.graphs: dict[int, tuple] = {}  # batch size -> (CUDAGraph, logits tensor)
        self.sizes: list[int] = []

    def capture(self, sizes: list[int], run: Callable[[int], tallow.Tensor], prepare: Callable[[int], None]) -> None:
        """For each size (largest first): prepare(size) fills the static inputs with a valid dummy
        batch, run(size) is issued once eagerly (one-time setup such as GEMM plans happens outside
        the capture) and then captured; its returned logits stay the graph's output."""
        self.pool = cuda.graph_pool_handle(self.device)
        for bs in sorted(sizes, reverse=True):
            prepare(bs)
            with cuda.stream(self.stream):
                run(bs)
            g = cuda.CUDAGraph()
            with cuda.stream(self.stream):
                # Captured on the engine's stream, so the recorded work is ordered with the eager steps.
                with cuda.graph(g, pool=self.pool, stream=self.stream):
                    logits = run(bs)
            self.graphs[bs] = (g, logits)
        self.stream.synchronize()
        self.sizes = sorted(self.graphs)

    def bucket(self, batch: int) -> Optional[int]:
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def replay(self, bs: int) -> tallow.Tensor:
        g, logits = self.graphs[bs]
        g.replay(self.stream)
        return logits

    def reset(self) -> None:
        for g, _ in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.sizes = []
        self.pool = None
