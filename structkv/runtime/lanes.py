"""The shared prefill: one pass of `Decoder.run` for many methods, in lanes that fork.

The loop is `Decoder.run` with an `on_layer` hook. Per layer, for every method riding the current
token stream: if its plan selects this layer's KV, rank the tokens by `method.kv_scores` and keep
the window plus the best (`Retention`); store the layer's entries in its cache; let its
propagation decide whether only some tokens go on. Deeper layers then compute on fewer tokens:
the prefill saving, reported as the fraction of token-layers computed.

Many methods share one pass. Methods with equal `prefill_key` form a lane: they compute the same
hidden states (every method that keeps all tokens to the last layer, at any budgets; one
propagating method at several KV budgets) and differ only in what each layer's cache keeps. All
lanes ride one stream until a lane propagates and forks off with its own tokens; the stream goes
on as that fork when no lane is left on it, otherwise the fork runs from the next layer after it.
A propagation may restart instead (`Propagation.restart_prompt`): the engine re-encodes the
prompt it gives with the full cache. Per layer every lane runs one sequence (`layer_steps`), and
the ledger's account times it from outside (`structkv.runtime.ledger`). Scores are computed once
per stream and layer (`LayerView` memoises them). The loop names no method: what a method does
lives in its file under `structkv.methods`.

Every token carries its original position (left padding = -1), so a kept subset attends exactly
as it would in the full prompt. Hybrid models (Gemma 3): only full-attention layers are planned or
scored; sliding layers keep their window as a ring.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..methods import Full, Method
from ..models.decoder import STOP, run_block
from ..modules import LayerView
from ..modules.budgeted_cache import BudgetedKVCache
from ..modules.decode_bound import seed_centrality
from ..util.timing import NO_TIMER, Timer, clock
from . import probe as probing
from .compressed_state import CompressedState, prefill_stats
from .ledger import LaneAccount, Ledger
from .method_pass import MethodPass, layer_steps, prepare


@dataclass
class Stream:
    """The tokens still computed: hidden states (B, n, E), original positions and prompt columns
    (B, n), and each row's count of real tokens (host ints: every size the loop needs is known on
    the host, so no layer reads the device back except for a decision that depends on the data)."""

    h: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor
    lengths: list[int]
    tp: object = None  # the model's TensorParallel group, if it is one rank's shard
    probe: int = 0  # the last `probe` tokens are a probe (`structkv.runtime.probe`), not context

    @classmethod
    def start(cls, model, tokens: torch.Tensor, positions: torch.Tensor, lengths: list[int],
              probe: int = 0) -> "Stream":
        B, S = tokens.shape
        pos = positions.clone()  # an inference tensor like every later one: no recompile after propagation
        cols = torch.arange(S, device=tokens.device).expand(B, S)
        return cls(model.embed(tokens), pos, cols, lengths, getattr(model, "tp", None), probe)

    def view(self, i: int, q, k, v, model, timer: Timer) -> LayerView:
        inv_freq = getattr(model, f"inv_freq_{model.config.layer_types[i]}")
        return LayerView(i, q, k, v, self.positions, self.columns, model.config.scale, timer=timer, tp=self.tp,
                         inv_freq=inv_freq, lengths=self.lengths)

    def kept_columns(self) -> torch.Tensor:
        """(B, n) prompt columns of the current tokens, -1 on padding."""
        return torch.where(self.positions >= 0, self.columns, torch.full_like(self.columns, -1))

    def gather(self, pruner, indices: torch.Tensor) -> "Stream":
        """The kept tokens (B, K) as a new stream, original positions kept."""
        h, cols, pos = pruner.gather(indices, self.h, self.columns, positions=self.positions)
        return Stream(h, pos, cols, pruner.counts, self.tp, self.probe)

@dataclass
class _Target(MethodPass):
    """A `MethodPass` in a shared prefill, with the seconds of the work it needed (the ledger's
    account) and the state it ends with."""

    own: Timer = field(default_factory=lambda: Timer(enabled=False))  # phase totals, filled by the ledger
    other_s: float = 0.0  # layer blocks, logits, restart
    state: CompressedState | None = None

@dataclass
class _Lane:
    """Methods with one `prefill_key`: they propagate the same tokens, by the first one's rule."""

    targets: list[_Target]
    prop: object  # the lead method's Propagation, or None
    processed: list[int] = field(default_factory=list)  # tokens computed per layer
    done: bool = False

def plan_method(model, method: Method, lengths, num_tokens: int, room: int, archive: str | None = None) -> _Target:
    """`prepare` on the model's config, as a target of the shared pass."""
    cfg = model.config
    p = prepare(method, cfg, lengths, cfg.num_kv_heads, cfg.head_dim, room, model.dtype, model.device, num_tokens,
                model.kv_dtype, archive)
    return _Target(p.method, p.plan, p.prop, p.store)

def run_pass(model, tokens, positions, methods, room, compile, timer, observe, probe: int = 0, archive=None,
              block=None):
    """The pass of `compress_shared` for methods on the same tokens (the last `probe` a probe);
    `archive`: one kind (or None) per method."""
    ledger = Ledger(timer)
    t0, lengths = clock(), (positions >= 0).sum(1)
    rows = lengths.tolist()  # the one read-back before the layers: every later size follows from it
    with ledger.timer.phase("plan"):
        targets = [plan_method(model, m, lengths, tokens.shape[1], room, kind)
                   for m, kind in zip(methods, archive or [None] * len(methods))]
    lanes = _lanes(targets)
    block = block or layer_block(compile, model.config)
    pending = [(0, Stream.start(model, tokens, positions, rows, probe), lanes, observe)]
    context = lengths - probe  # what the states and their stats speak of
    while pending:
        _run_stream(model, tokens, *pending.pop(0), pending, context, room, compile, ledger, block)
    states = _states(model, targets, lanes, context, clock() - t0, ledger)
    _carry_centrality(lanes, positions)
    return states

def _carry_centrality(lanes: list[_Lane], positions: torch.Tensor) -> None:
    """A StructKV lane's centrality goes on with its states' caches: a decode bound's "centrality"
    rule starts from it (`structkv.modules.decode_bound`), at one layer's scale."""
    for lane in lanes:
        tracker = getattr(lane.prop, "tracker", None)
        if tracker is None or tracker.value is None or not tracker.layers:
            continue
        for target in lane.targets:
            seed_centrality(target.state.cache, tracker.per_layer(), positions)

def _lanes(targets: list[_Target]) -> list[_Lane]:
    groups: dict[tuple, list[_Target]] = {}
    for t in targets:
        groups.setdefault(t.method.prefill_key(), []).append(t)
    lanes = []
    for members in groups.values():
        lanes.append(_Lane(members, members[0].prop))  # `prepare` began each propagation
    return lanes

def _run_stream(model, tokens, start: int, stream: Stream, riders: list[_Lane], observe, pending, lengths, room,
                compile, ledger: Ledger, block) -> None:
    """Layers `start`.. of one stream through `Decoder.run`; lanes that propagate fork off (the
    stream continues as a fork when no lane stays on it)."""

    def on_layer(i, h, positions, q, k, v):
        nonlocal stream, riders, observe
        ledger.charge(_targets(riders), ledger.since_mark(), "blocks")
        stream.h = h
        view = stream.view(i, q, k, v, model, ledger.timer)
        if observe is not None:
            observe(view)
        forks = []
        for lane in riders:
            kept = _layer(model, tokens, lane, view, lengths, room, compile, ledger)
            if kept is not None and not lane.done:
                forks.append((lane, stream.gather(lane.prop.pruner, kept)))
        staying = [lane for lane in riders if not lane.done and all(lane is not f for f, _ in forks)]
        for lane, fork in forks[1:] if not staying else forks:
            pending.append((i + 1, fork, [lane], None))
        ledger.since_mark()  # selection and propagation were charged by their own phases
        if staying:
            riders = staying
            return None
        if not forks:
            riders = []
            return STOP
        lane, stream = forks[0]
        riders, observe = [lane], None
        return stream.h, stream.positions

    ledger.since_mark()
    h, _ = model.run(stream.h, stream.positions, start=start, on_layer=on_layer, block=block)
    if riders:
        stream.h = h
        _finish(model, tokens, stream, riders, lengths, ledger)

def _targets(lanes: list[_Lane]) -> list[_Target]:
    return [t for lane in lanes for t in lane.targets]

def _layer(model, tokens, lane: _Lane, view, lengths, room, compile, ledger: Ledger):
    """One layer of one lane, timed by the ledger; the kept token indices (B, K) when the lane
    propagates here (a restart finishes the lane instead)."""
    lane.processed.append(sum(view.lengths))
    window = lane.prop.window_needed(view.layer) if lane.prop is not None else None
    if window:
        view.window_scores(window)
    account = LaneAccount(ledger.timer, {("window", window)} if window else set())
    kept = layer_steps(lane.targets, lane.prop, view, account)
    if kept is not None and lane.prop.restart:
        _restart(model, tokens, lane, view, kept, lengths, room, compile, ledger)
    return kept

def _restart(model, tokens, lane: _Lane, view, kept, lengths, room, compile, ledger: Ledger) -> None:
    """A propagation that restarts: the prompt it gives (`restart_prompt`) re-encoded uncompressed
    from layer 0 is the lane's state. Such a method has a prefill key of its own: one target."""
    (target,) = lane.targets
    with ledger.timer.phase("restart") as span:
        ids, positions, columns = lane.prop.restart_prompt(tokens, view, kept)
        target.state = run_pass(model, ids, positions, [Full()], room, compile, NO_TIMER, None, archive=[None])[0]
        target.state.kept_columns = columns
        target.state.method, target.state.lengths = target.method, lengths.tolist()
    ledger.charge([target], span.seconds)
    lane.processed += target.state.stats.tokens_per_layer
    lane.done = True

def _finish(model, tokens, stream: Stream, lanes: list[_Lane], lengths, ledger: Ledger) -> None:
    """Last-token logits once for the stream, then each of its lanes' states."""
    t = clock(sync=ledger.timer.enabled)
    logits = model.logits(stream.h[:, -1 - stream.probe])  # the context's last token (a probe follows it)
    next_positions = stream.positions.max(dim=1, keepdim=True).values + 1  # (B, 1)
    kept = stream.kept_columns()
    ledger.charge(_targets(lanes), clock(sync=ledger.timer.enabled) - t, "logits")
    for lane in lanes:
        lane.done = True
        memo = {}  # work a store shares with the lane's other methods (same tokens at every layer)
        for target in lane.targets:
            with ledger.timer.phase("finish") as span:  # a store's own pass over the prompt runs here
                target.store.finish(model, tokens, memo)
            extra = target.store.extra_pass  # shared in the lane, charged to each in full
            target.own.totals["finish"] += extra["seconds"] if extra else span.seconds
            target.state = CompressedState(target.store.cache, logits, next_positions, lengths.tolist(),
                                           target.method, None, kept, archive=_archive(target.store.cache))
            if stream.probe:
                probing.drop(target.state, stream.probe)  # before the stats: they count what stays

def _archive(cache: BudgetedKVCache):
    """The evicted entries the cache collected, as a `KVArchive` taken out of it (a cloned cache
    must not copy them), or None when none was asked for."""
    from ..models.archive import KVArchive

    if cache.archive_kind is None:
        return None
    out = KVArchive(cache.archive_kind, dict(cache.evicted))
    cache.archive_kind, cache.evicted = None, {}
    return out

def _states(model, targets: list[_Target], lanes: list[_Lane], lengths, elapsed: float, ledger: Ledger):
    """Each target's state with its stats."""
    timer = ledger.timer
    overhead = max(elapsed - timer.total(), 0.0)
    out = []
    for lane in lanes:
        processed = lane.processed
        for target in lane.targets:
            state = target.state
            alone = target.other_s + target.own.total() + overhead if timer.enabled and len(targets) > 1 else elapsed
            extra = target.store.extra_pass if target.store is not None else None  # the context run again
            state.stats = prefill_stats(model, target.method, lengths, processed, state.cache, lane.prop, alone,
                                        _own(target) if timer.enabled else NO_TIMER, extra)
            if len(targets) > 1:
                state.stats.shared_prefill = {"methods": len(targets), "lanes": len(lanes), "pass_s": elapsed,
                                              "untimed_s": overhead}
            state.source = weakref.ref(model)
    for target in targets:
        out.append(target.state)
    return out

def _own(target: _Target) -> Timer:
    """The target's own phase seconds as a Timer (what `prefill_stats` reads)."""
    out = Timer()
    out.totals.update(target.own.totals)
    return out

def layer_block(compile, cfg):
    """`run_block`, or its compiled form with the token dimension marked dynamic, so one graph per
    layer kind serves every length, before and after propagation."""
    if not compile:
        return run_block
    from ..util.compiling import compiled

    fn = compiled(run_block, "inductor" if compile is True else compile, fullgraph=True)

    def block(layer, h, positions, cos, sin, ordered=None):
        for x, dim in ((h, 1), (positions, 1), (cos, 2), (sin, 2)):
            torch._dynamo.mark_dynamic(x, dim, min=2, max=cfg.max_position_embeddings)
        return fn(layer, h, positions, cos, sin, ordered)  # `ordered` a Python bool: one graph per value

    return block
