"""An optional phase timer for the prefill loop: does nothing unless asked for.

`Timer()` adds up wall time per named phase; on CUDA it synchronises at each phase boundary so the
numbers mean something (that costs throughput, which is why the default is `NO_TIMER`, whose
phases are free). A phase yields a record whose `seconds` is set on exit, so a caller can charge
one phase to several owners (the shared prefill does).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


def clock(sync: bool = True) -> float:
    """Wall time, after the GPU finished its queued work when `sync` and CUDA is in use."""
    if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Span:
    """One phase's own seconds (set on exit), not counting phases nested inside it."""

    seconds: float = 0.0
    nested: float = 0.0


class Timer:
    """Seconds per phase name; `enabled=False` makes every phase a no-op. Phases may nest: each
    counts only its own time, so `totals` adds every second once."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self._open: list[Span] = []

    @contextmanager
    def phase(self, name: str):
        span = Span()
        if not self.enabled:
            yield span
            return
        t = clock()
        self._open.append(span)
        try:
            yield span
        finally:
            self._open.pop()
            elapsed = clock() - t
            span.seconds = elapsed - span.nested
            self.totals[name] += span.seconds
            if self._open:
                self._open[-1].nested += elapsed

    def total(self) -> float:
        return sum(self.totals.values())


NO_TIMER = Timer(enabled=False)
