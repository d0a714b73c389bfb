"""CUDA-event timing shared by the GPU benchmarks (bench_attention.py, bench_sampling.py, ...), and
where they write their results by default."""
from __future__ import annotations

import os
import re
import statistics


def results_path(prefix: str, device_name: str) -> str:
    """benchmarks/results/<prefix>_<device name as lower-case words joined by _>.json."""
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "%s_%s.json" % (prefix, slug))


def time_ms(fn, calls: int, reps: int, warm: int = 3) -> float:
    """Median milliseconds per call: events around `calls` back-to-back calls fn(i), `reps` times."""
    from tallow import cuda as tc

    for i in range(warm):
        fn(i)
    tc.synchronize()
    times = []
    for _ in range(reps):
        s, e = tc.Event(True), tc.Event(True)
        s.record()
        for i in range(calls):
            fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)


def time_graph_ms(fn, calls: int, reps: int):
    """Median milliseconds per call of `calls` calls captured in one CUDA graph (as the engine's decode
    steps run: no host overhead between kernels), or None when the capture fails."""
    from tallow import cuda as tc

    try:
        g = tc.CUDAGraph()
        with tc.graph(g):
            for i in range(calls):
                fn(i)
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print("    graph capture failed (%s); eager timing only" % e)
        return None
    for _ in range(2):
        g.replay()
    tc.synchronize()
    times = []
    for _ in range(reps):
        s, e = tc.Event(True), tc.Event(True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)
