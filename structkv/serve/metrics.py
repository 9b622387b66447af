"""Counters and latency histograms of one server, written in the Prometheus text format (0.0.4).

Owned by the server's app (no module-level registry): two servers in one process keep their own.
"""
from __future__ import annotations

from collections import defaultdict
from threading import Lock

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self):
        self.counts = [0] * len(BUCKETS)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
        self.total += seconds
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(BUCKETS, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


class Metrics:
    HISTOGRAMS = {
        "request_seconds": "wall time of a request, queue included",
        "time_to_first_token_seconds": "from arrival to the first generated token",
        "prefill_seconds": "prefill of what was not cached (the compression, or the new turn after a cached context)",
        "queue_seconds": "time a request waited for the model",
    }

    def __init__(self):
        self._lock = Lock()
        self.requests: dict = defaultdict(int)  # (endpoint, status) -> count
        self.counters: dict = defaultdict(int)  # prompt_tokens, completion_tokens, cancelled, ...
        self.histograms = {name: Histogram() for name in self.HISTOGRAMS}

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self.histograms[name].observe(seconds)

    def text(self, gauges: dict) -> str:
        """Everything, as Prometheus scrapes it; `gauges`: name -> (help, value) read at scrape time."""
        p = "structkv_"
        with self._lock:
            lines = [f"# HELP {p}requests_total requests answered, by endpoint and HTTP status",
                     f"# TYPE {p}requests_total counter"]
            lines += [f'{p}requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            for name, n in sorted(self.counters.items()):
                lines += [f"# TYPE {p}{name}_total counter", f"{p}{name}_total {n}"]
            for name, h in self.histograms.items():
                lines += [f"# HELP {p}{name} {self.HISTOGRAMS[name]}", f"# TYPE {p}{name} histogram",
                          *h.lines(p + name)]
        for name, (help_, value) in gauges.items():
            lines += [f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} gauge", f"{p}{name} {value}"]
        return "\n".join(lines) + "\n"
