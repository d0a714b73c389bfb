"""The engine's errors (the server maps each to an HTTP status)."""
from __future__ import annotations


class KVCacheFullError(RuntimeError):
    """The KV cache cannot take this work right now (a server answers 503: retry later)."""


class SchedulerStalledError(RuntimeError):
    """The scheduler made no progress: the KV cache cannot hold the waiting request."""


class EngineDeadError(RuntimeError):
    """The engine has shut down, or its step thread died; no request can be served."""


class EngineStepError(RuntimeError):
    """A model step failed; the requests in the engine at that time were aborted."""
