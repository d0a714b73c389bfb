"""tallow.cuda: the CUDA runtime of tallow's core (no torch needed).

Devices (``is_available``, ``device_count``, ``mem_get_info``, ``synchronize``), the caching
device allocator's statistics (``memory_stats``, ``memory_allocated``, ``empty_cache``), streams
and events, and CUDA graphs::

    import tallow, tallow.cuda as tc
    x = tallow.tensor(np.random.randn(8, 4096), dtype="bfloat16").to("cuda")
    s = tc.Stream()
    g = tc.CUDAGraph()
    with tc.graph(g, stream=s):                 # ops called here are captured, not run
        y = tallow.ops.rms_norm(x, w, eps=1e-6)
    x.copy_(new_x)                              # update the static input in place ...
    g.replay()                                  # ... and y holds the new result after replay

Tensors move with ``t.to("cuda")`` / ``t.to("cpu")``. In a build without the CUDA backend,
``is_available()`` is False and the rest raises RuntimeError saying why.
"""
from __future__ import annotations

import contextlib

from tallow import _core

_c = _core.cuda
built: bool = bool(_c.built)


def is_available() -> bool:
    """True when this build has the CUDA backend and a driver with at least one device."""
    return built and bool(_c.is_available())


def device_count() -> int:
    return int(_c.device_count()) if built else 0


def _index(device) -> int:
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    d = _core.Device(str(device))
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return d.index


def current_device() -> int:
    return _c.current_device()


def set_device(device) -> None:
    _c.set_device(_index(device))


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of device memory, as the driver reports them."""
    return tuple(_c.mem_get_info(_index(device)))


def synchronize(device=None) -> None:
    """Wait for all work queued on the device."""
    _c.synchronize(_index(device))


def get_device_properties(device=None) -> dict:
    return _c.get_device_properties(_index(device))


def get_device_name(device=None) -> str:
    return get_device_properties(device)["name"]


# ---- memory -----------------------------------------------------------------------------------
def memory_stats(device=None) -> dict:
    """Caching allocator statistics: allocated/requested/reserved/peak bytes, counts, cache hits."""
    return _c.memory_stats(_index(device))


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["peak_allocated_bytes"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes"]


def reset_peak_memory_stats(device=None) -> None:
    _c.reset_peak_memory_stats(_index(device))


def empty_cache() -> None:
    """Give cached (free) device blocks back to the driver; live tensors and graph pools stay."""
    _c.empty_cache()


def empty_pinned(shape, dtype="float32"):
    """A CPU tensor in page-locked memory: the target of copy_to_host_async."""
    return _c.empty_pinned(list(shape), dtype)


def copy_to_host_async(dst, src) -> None:
    """Queue src (CUDA) -> dst (pinned CPU) on the current stream and return at once; record an
    Event after it and synchronize that before reading dst."""
    _c.copy_to_host_async(dst, src)


def set_index_checks(on: bool) -> None:
    """Turn the device-side validation of rotary positions, embedding ids and paged-KV slots/block ids
    on (default) or off. On, each such op reads a flag back (a wait on the stream) to raise
    IndexError/ValueError like the CPU ops; an engine that builds those indices itself can skip it."""
    _c.set_index_checks(bool(on))


def index_checks() -> bool:
    return bool(_c.index_checks())


# ---- streams and events -----------------------------------------------------------------------
if built:
    Stream = _c.Stream
    Event = _c.Event
    CUDAGraph = _c.CUDAGraph
    GraphPool = _c.GraphPool
else:  # pragma: no cover - CPU builds
    def _unavailable(*_a, **_k):
        raise RuntimeError("tallow was built without the CUDA backend")

    Stream = Event = CUDAGraph = GraphPool = _unavailable


def current_stream(device=None):
    """This thread's current stream on the device (ops run on it)."""
    return _c.current_stream(_index(device))


def default_stream(device=None):
    return _c.default_stream(_index(device))


def set_stream(stream) -> None:
    _c.set_current_stream(stream)


@contextlib.contextmanager
def stream(s):
    """Make `s` the current stream of its device inside the block (None: no change)."""
    if s is None:
        yield None
        return
    prev = _c.current_stream(s.device)
    _c.set_current_stream(s)
    try:
        yield s
    finally:
        _c.set_current_stream(prev)


# ---- graphs -----------------------------------------------------------------------------------
def graph_pool_handle(device=None):
    """A memory pool that several graphs can share (pass it as ``pool=``)."""
    return _c.graph_pool_handle(_index(device))


class graph:
    """Capture the ops issued inside the block into `cuda_graph` (replay with ``cuda_graph.replay()``).

    Capture runs on `stream` (a new stream by default), made current for the block and ordered
    after the current stream's earlier work. Allocations inside come from the graph's pool (or
    `pool`, shared with other graphs) and stay valid for replays. Run the ops once before
    capturing so one-time setup (library handles, workspaces) happens outside the capture.
    Host<->device copies cannot be captured; update static inputs with ``copy_`` between replays.
    """

    def __init__(self, cuda_graph, pool=None, stream=None):
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.capture_stream = stream if stream is not None else Stream()
        self._ctx = None

    def __enter__(self):
        self.capture_stream.wait_stream(current_stream(self.capture_stream.device))
        self._ctx = stream(self.capture_stream)
        self._ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(self.capture_stream, self.pool)
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise
        return self.cuda_graph

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.cuda_graph.capture_end()
            else:
                self.cuda_graph.reset()
        finally:
            self._ctx.__exit__(exc_type, exc, tb)
        return False


__all__ = [
    "built", "is_available", "device_count", "current_device", "set_device", "mem_get_info", "synchronize",
    "get_device_properties", "get_device_name", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "reset_peak_memory_stats", "empty_cache", "empty_pinned", "copy_to_host_async", "set_index_checks", "index_checks", "Stream", "Event", "CUDAGraph", "GraphPool",
    "current_stream", "default_stream", "set_stream", "stream", "graph_pool_handle", "graph",
]
