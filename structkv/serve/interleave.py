"""A prefill that makes way: the running requests' decode steps run at its pause points.

A sliced prefill (`structkv.models.sliced`) calls `pause()` between slices of its layers. The
server's `Interleave` is that callable: once the prefill has run for its slice's seconds, it runs
one decode step of the batch, then lets the prefill go on. Why inline, on the same thread: the
prefill's pause points are deep inside its call (compression, probes, archives, the context
cache), and a callback reaches them without a generator version of every prefill path. One
thread, not two: a first version ran the prefill on its own thread and handed control back and
forth, and the decode steps between its slices ran markedly slower (likely the idle thread's
OpenMP workers spinning on the cores the step needed; research/benchmarks_log.md). So the model is
never used by two threads at once, and a long prompt no longer stops every stream for its whole
prefill (chunked prefill, in time rather than in tokens: every method's prefill stays whole).
"""
from __future__ import annotations

import time


class Stopped(Exception):
    """Raised inside the prefill at a pause point when it should end (its client left, the server closes)."""


class Interleave:
    """The `pause` callable of a sliced prefill.

    Args: step: runs one decode step of the running requests; budget: seconds a prefill slice may
    run before the next step (called at each pause point, so it follows the batch: infinite when
    nothing runs); stop: True when the prefill should end (then `Stopped` is raised inside it).
    """

    def __init__(self, step, budget, stop=lambda: False):
        self.step, self.budget, self.stop = step, budget, stop
        self.steps = 0  # decode steps run inside the prefill
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if self.stop():
            raise Stopped
        if time.perf_counter() - self._since < self.budget():
            return
        self.step()
        self.steps += 1
        if self.stop():
            raise Stopped
        self._since = time.perf_counter()
