"""Where the seconds of a shared prefill go: the phase timer and, per method, what it would have
cost alone (`Ledger`, `LaneAccount`); `UNTIMED` for a prefill that times nothing.

With more than one method, a state's `prefill_s` is the work its method needed, shared work counted
in full (what it would have cost alone); `stats.shared_prefill` has the whole pass and the time no
phase accounts for (`untimed_s`, charged to every method).
"""
from __future__ import annotations

from contextlib import contextmanager

from ..util.timing import Timer, clock


class Ledger:
    """Where the seconds of a pass go: the phase timer (`timer`) and, per method, what it would
    have cost alone. A disabled timer times nothing (no GPU syncs); each state's `prefill_s` is
    then the whole pass."""

    def __init__(self, timer: Timer):
        self.timer, self.mark = timer, clock(sync=timer.enabled)

    def since_mark(self) -> float:
        """Seconds since the last mark (the layer block the loop just ran), and a new mark."""
        now = clock(sync=self.timer.enabled)
        spent, self.mark = now - self.mark, now
        return spent if self.timer.enabled else 0.0

    def charge(self, targets, seconds: float, phase: str | None = None) -> None:
        """Charge `seconds` of shared work (a layer block, the logits, a restart) to each target;
        `phase`: also count them in the timer's phase (None: the timer already did)."""
        if not self.timer.enabled:
            return
        if phase is not None:
            self.timer.totals[phase] += seconds
        for t in targets:
            t.other_s += seconds

class _Untimed:
    """The account of a prefill that times nothing (`MethodPass.layer` in a decoder of your own)."""

    @contextmanager
    def store(self, member, view):
        yield

    @contextmanager
    def propagation(self, members, prop):
        yield

    @contextmanager
    def selection(self, member):
        yield

UNTIMED = _Untimed()

class LaneAccount:
    """Charges one lane's layer to each of its methods (what it would have cost alone): its own
    selection, cache fill and scores, and the propagation's time and statistics in full to every
    method riding it. `shared`: score keys the lane computed for the propagation (counted for all)."""

    def __init__(self, timer: Timer, shared: set):
        self.timer, self.shared = timer, shared

    @contextmanager
    def store(self, target, view):
        view.used = set()
        if target.store is None:
            yield
        else:
            filled = self.timer.totals["cache_fill"]
            with self.timer.phase("selection") as span:
                yield
            target.own.totals["selection"] += span.seconds
            target.own.totals["cache_fill"] += self.timer.totals["cache_fill"] - filled
        target.own.totals["scoring"] += view.seconds(view.used | self.shared)

    @contextmanager
    def propagation(self, targets, prop):
        before = prop.scoring_s
        with self.timer.phase("propagation") as span:
            yield
        for target in targets:
            target.own.totals["scoring"] += prop.scoring_s - before
            target.own.totals["propagation"] += span.seconds

    @contextmanager
    def selection(self, target):
        with self.timer.phase("selection") as span:
            yield
        target.own.totals["selection"] += span.seconds
