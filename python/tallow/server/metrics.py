"""Prometheus metrics (prometheus_client text format), one registry per app.

Engine gauges and token counters are read from the engine's statistics snapshot at scrape time;
request latencies are observed by the server as streams finish. With several API server processes
(--api-server-count), prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by
`tallow serve` before anything imports prometheus_client) adds up every process's request metrics, so
a scrape answered by any one of them counts them all."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


def share_between_processes(path: str) -> None:
    """Keep request metrics in `path` from now on, for this process and the API server processes it
    starts (prometheus_client's multiprocess mode). prometheus_client picks its value store when it
    is imported, which tallow.server has done already, so the store is switched here too; only
    metrics created afterwards use it (call before build_app)."""
    from prometheus_client import metrics, values

    from tallow import envs

    envs.export("PROMETHEUS_MULTIPROC_DIR", path)
    values.ValueClass = metrics.ValueClass = values.MultiProcessValue()


class _EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _gauge(self, name, doc, value):
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), float(value))
        return g

    def _counter(self, name, doc, value):
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), float(value))
        return c

    def collect(self):
        s = self.engine.stats
        yield self._gauge("tallow:num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield self._gauge("tallow:num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield self._gauge("tallow:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                          s.get("kv_usage", 0.0))
        yield self._gauge("tallow:prefix_cache_hit_rate",
                          "Prefix-cache hits over lookups (in blocks) since start (0 to 1).",
                          s.get("prefix_cache_hit_rate", 0.0))
        yield self._counter("tallow:prefix_cache_queries", "Prefix-cache lookups (blocks).",
                            s.get("prefix_cache_queries", 0))
        yield self._counter("tallow:prefix_cache_hits", "Prefix-cache hits (blocks).", s.get("prefix_cache_hits", 0))
        yield self._counter("tallow:prompt_tokens", "Prompt tokens of the requests added.", s.get("prompt_tokens", 0))
        yield self._counter("tallow:generation_tokens", "Tokens generated.", s.get("generation_tokens", 0))
        yield self._counter("tallow:engine_step_errors", "Model steps that failed.", s.get("step_errors", 0))


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("tallow:time_to_first_token_seconds", "Time from request arrival to its first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("tallow:inter_token_latency_seconds", "Time between successive output tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("tallow:e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("tallow:request_success", "Requests finished, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._http = Counter("tallow:http_requests", "HTTP requests answered, by endpoint and status.",
                             ["endpoint", "status"], registry=self.registry)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def http(self, endpoint: str, status: int) -> None:
        self._http.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        from tallow import envs

        if not envs.PROMETHEUS_MULTIPROC_DIR:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # every API process's counters and histograms
        registry.register(self._engine_collector)  # the engine's gauges: the same in every process
        return generate_latest(registry)
