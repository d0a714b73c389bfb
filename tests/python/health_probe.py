"""A thread that asks a server's /health every 50 ms and keeps the worst latency it saw: the server
tests run hostile traffic inside ``with HealthProbe(url) as probe:`` and then assert that no request
held up the event loop (probe.worst < 1 s)."""
from __future__ import annotations

import threading
import time

import requests


class HealthProbe:
    def __init__(self, base_url: str, interval: float = 0.05, timeout: float = 30.0):
        self.url = base_url + "/health"
        self.interval = interval
        self.timeout = timeout
        self.worst = 0.0
        self.count = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._session = requests.Session()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                r = self._session.get(self.url, timeout=self.timeout)
                if r.status_code != 200:
                    self.failures.append(f"/health answered {r.status_code}: {r.text[:200]}")
            except requests.RequestException as e:
                self.failures.append(f"/health failed: {e}")
            self.worst = max(self.worst, time.monotonic() - t0)
            self.count += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)
        self._session.close()

    def assert_responsive(self, limit: float = 1.0) -> None:
        assert self.count > 0, "the health probe never ran"
        assert not self.failures, self.failures[:3]
        assert self.worst < limit, f"/health took {self.worst:.2f} s at worst while the traffic ran"
