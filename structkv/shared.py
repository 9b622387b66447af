"""compress_shared: one prefill pass for many methods, each state equal to `compress(method)` alone.

Methods with equal `prefill_key` form a lane: they compute the same hidden states to the last
layer (full, StreamingLLM, SnapKV, PyramidKV, H2O at any budgets; FastKV or StructKV at several
KV budgets) and differ only in what each layer's cache keeps. All lanes share one stream of
hidden states until a lane propagates (FastKV's TSP layer, StructKV's pivot, GemFilter's restart)
and goes on with its own tokens. Scores are computed once per stream and layer (`LayerView`
memoises them). The per-layer pieces are `compress`'s own.

Timings: a state's `prefill_s` is the work its method needed, shared work counted in full (what
it would have cost alone); `stats.shared_prefill["pass_s"]` is the whole pass, and what no piece
accounts for (`untimed_s`, host overhead) is charged to every method.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .compress import (
    CompressedState,
    Stream,
    check_scorable,
    layer_block,
    plan_method,
    prefill_stats,
    restart,
)
from .methods import Full, Method
from .timing import Timer, clock


@dataclass
class _Target:
    """One method's share of the pass: its plan, its cache and the seconds of the work it needed."""

    method: Method
    plan: dict[int, list[int]]
    prop: object  # its Propagation (a lane runs its first method's)
    store: object  # its Retention (holds the cache), None when the method restarts
    own: Timer = field(default_factory=lambda: Timer(enabled=False))  # totals only, filled by hand
    other_s: float = 0.0  # embedding, layer blocks, logits, restart


@dataclass
class _Lane:
    """Methods with one `prefill_key`: they propagate the same tokens, by the first one's rule."""

    targets: list[_Target]
    stream: Stream
    prop: object  # the lead method's Propagation, or None
    processed: list[int] = field(default_factory=list)
    states: list[CompressedState] | None = None  # set when the lane ends (early for GemFilter)


@torch.inference_mode()
def compress_shared(model, tokens: torch.Tensor, positions: torch.Tensor, methods: list[Method],
                    room: int = 256, compile=False) -> list[CompressedState]:
    """Compress `tokens` (B, S) at `positions` with every method of `methods` in one pass; the
    states come back in the order of `methods`."""
    methods = [m or Full() for m in methods]
    if not methods:
        raise ValueError("compress_shared needs at least one method")
    cfg = model.config
    check_scorable(cfg)
    timer, t0, lengths = Timer(), clock(), (positions >= 0).sum(1)
    block = layer_block(compile, cfg)
    with timer.phase("plan"):
        targets, lanes = _plan(model, tokens, positions, methods, lengths, room)
    for target in targets:
        target.other_s += timer.totals["plan"]
    for i in range(cfg.num_layers):
        active = [lane for lane in lanes if lane.states is None]
        views = {}
        for stream in {id(lane.stream): lane.stream for lane in active}.values():  # one block per stream
            with timer.phase("blocks") as span:
                views[id(stream)] = stream.view(i, stream.run_layer(model, i, block), cfg.scale, timer)
            for target in (t for lane in active if lane.stream is stream for t in lane.targets):
                target.other_s += span.seconds
        for lane in active:
            _layer(model, tokens, lane, views[id(lane.stream)], lengths, room, compile, timer)
    with timer.phase("logits"):
        _finish(model, lanes, lengths)
    elapsed = clock() - t0
    overhead = max(elapsed - timer.total(), 0.0)
    for lane in lanes:
        for target, state in zip(lane.targets, lane.states):
            alone = target.other_s + target.own.total() + overhead
            state.stats = prefill_stats(model, target.method, lengths, lane.processed, state.cache, lane.prop,
                                        alone, _own(target))
            if len(targets) > 1:
                state.stats.shared_prefill = {"methods": len(targets), "lanes": len(lanes), "pass_s": elapsed,
                                              "untimed_s": overhead}
            state.source = weakref.ref(model)
    return [next(s for lane in lanes for t, s in zip(lane.targets, lane.states) if t is target) for target in targets]


def _plan(model, tokens, positions, methods, lengths, room):
    S = tokens.shape[1]
    targets, groups = [], {}
    for m in methods:
        targets.append(_Target(m, *plan_method(model, m, lengths, S, room)))
        groups.setdefault(m.prefill_key(), []).append(targets[-1])
    trunk = Stream.start(model, tokens, positions)
    lanes = []
    for members in groups.values():
        prop = members[0].prop
        if prop is not None:
            prop.begin(S, tokens.device)
        lanes.append(_Lane(members, trunk, prop))
    return targets, lanes


def _layer(model, tokens, lane: _Lane, view, lengths, room, compile, timer: Timer) -> None:
    """One layer of one lane: each method's cache, then the lane's propagation."""
    lane.processed.append(int(view.valid.sum()))
    window = lane.prop.window_needed(view.layer) if lane.prop is not None else None
    lane_keys = {("window", window)} if window else set()
    if window:
        view.window_scores(window)
    for target in lane.targets:
        view.used = set()
        if target.store is not None:
            filled = timer.totals["cache_fill"]
            with timer.phase("selection") as span:
                target.store.layer(view)
            target.own.totals["selection"] += span.seconds
            target.own.totals["cache_fill"] += timer.totals["cache_fill"] - filled
        target.own.totals["scoring"] += view.seconds(view.used | lane_keys)
    if lane.prop is None:
        return
    before = lane.prop.scoring_s
    with timer.phase("propagation") as span:
        kept = lane.prop.after_layer(view)
    for target in lane.targets:
        target.own.totals["scoring"] += lane.prop.scoring_s - before
        target.own.totals["propagation"] += span.seconds
        if target.store is not None and not lane.prop.restart:
            with timer.phase("selection") as span:
                target.store.after_propagation(lane.prop)  # a guided retention may select held layers now
            target.own.totals["selection"] += span.seconds
    if kept is None:
        return
    if lane.prop.restart:  # GemFilter: its own key, so one target
        (target,) = lane.targets
        with timer.phase("restart") as span:
            state = restart(model, tokens, lane.stream, kept, target.method, lane.prop, lane.processed, lengths,
                            room, compile, 0.0, Timer(enabled=False))
        target.other_s += span.seconds
        lane.processed += state.stats.tokens_per_layer[len(lane.processed):]
        lane.states = [state]
        return
    lane.stream = lane.stream.gather(model, lane.prop.pruner, kept)


def _finish(model, lanes: list[_Lane], lengths) -> None:
    """Last-token logits once per stream, then each remaining lane's states."""
    finals = {}
    for lane in (lane for lane in lanes if lane.states is None):
        st = lane.stream
        if id(st) not in finals:
            t = clock()
            finals[id(st)] = (model.logits(st.h[:, -1]), st.positions.max(dim=1, keepdim=True).values + 1,
                              st.kept_columns(),
                              clock() - t)
        logits, next_positions, kept, spent = finals[id(st)]
        for target in lane.targets:
            target.other_s += spent
        for t in lane.targets:
            t.store.finish()
        lane.states = [CompressedState(t.store.cache, logits, next_positions, lengths.tolist(), t.method, None, kept)
                       for t in lane.targets]


def _own(target: _Target) -> Timer:
    """The target's own phase seconds as a Timer (what `prefill_stats` reads)."""
    out = Timer()
    out.totals.update(target.own.totals)
    return out
