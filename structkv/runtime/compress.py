"""compress: the one prefill loop, for one method or many at once.

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
the ledger's account times it from outside. Scores are computed once per stream and layer
(`LayerView` memoises them). `compress(model, ..., method)` is this engine with one method;
calibration (`structkv.runtime.calibration`) is this engine with an observer. The loop names no
method: what a method does lives in its file under `structkv.methods`.

Every token carries its original position (left padding = -1), so a kept subset attends exactly
as it would in the full prompt. Hybrid models (Gemma 3): only full-attention layers are planned or
scored; sliding layers keep their window as a ring.

Timings go to a `Ledger`: with more than one method, a state's `prefill_s` is the work its method
needed, shared work counted in full (what it would have cost alone); `stats.shared_prefill` has
the whole pass and the time no phase accounts for (`untimed_s`, charged to every method).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..methods import Full, Method
from ..models.decoder import STOP, run_block
from ..modules import LayerView
from ..modules.budgeted_cache import BudgetedKVCache
from ..modules.decode_bound import seed_centrality
from ..text.prompts import encode_batch, is_batch
from ..util.timing import NO_TIMER, Timer, clock
from . import probe as probing
from .stats import PrefillStats


@dataclass
class CompressedState:
    """A prompt compressed once: the cache, the last logits and where positions continue."""

    cache: BudgetedKVCache
    logits: torch.Tensor  # (B, V) float32, next-token logits after the prompt
    next_positions: torch.Tensor  # (B, 1) position of the next token per row
    lengths: list[int]  # prompt tokens per row
    method: Method
    stats: PrefillStats | None = None
    kept_columns: torch.Tensor | None = None  # (B, K) prompt columns that reached the last layer, -1 = pad
    source: object = None  # weakref to the model that made it: a state only makes sense on that model
    messages: list | None = None  # the chat messages it holds, when made from messages
    archive: object = None  # a `KVArchive` of the entries the method evicted (ask-time recall), or None
    recall: float | int | None = None  # entries each archived layer recalls per question by default (a `Budget`)

    def check_model(self, model) -> None:
        """Refuse to extend this state with a model other than the one that made it."""
        if self.source is not None and self.source() is not model:
            raise ValueError("this compressed state was made by another model; call structkv.prefill(model, context, "
                             "method) with the model you generate with")


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
class MethodPass:
    """One method's share of a prefill: its per-layer KV plan, its propagation (None: none) and
    the `Retention` that fills its `BudgetedKVCache` (None when the propagation restarts: the
    restart makes the cache). `prepare` makes one; a decoder of your own calls `layer(view)`
    after each layer and `finish()` after the last (the prefill loop does the same, timed)."""

    method: Method
    plan: dict[int, list[int]]
    prop: object
    store: object

    @property
    def cache(self) -> BudgetedKVCache:
        return self.store.cache

    def layer(self, view) -> torch.Tensor | None:
        """Store layer `view.layer`'s entries, let the propagation see it; the kept token indices
        (B, K) when it propagates here (gather the hidden states with `prop.pruner.gather`)."""
        return layer_steps([self], self.prop, view)

    def finish(self, model=None, tokens=None) -> None:
        """After the last layer: entries a retention held for later are chosen now (a guide that
        never came, scores that need the whole prompt)."""
        self.store.finish(model, tokens)


def prepare(method: Method, layout, lengths: torch.Tensor, num_kv_heads: int, head_dim: int, room: int,
            dtype=torch.float32, device=None, num_tokens: int | None = None, kv_dtype: str | None = None,
            archive: str | None = None) -> MethodPass:
    """`method`'s plan, propagation and cache for prompts of `lengths` (B,) tokens on a model of
    `layout` (a `ModelConfig`, or a `Layout` for a decoder of your own: every layer full
    attention), `room` free slots per layer after the kept entries. `num_tokens`: the prompt's
    columns (padding included; default the longest row); `kv_dtype`: the cache's entries
    (`BudgetedKVCache`); `archive`: keep the evicted entries in this kind (`structkv.models.archive`)."""
    num_tokens = int(lengths.max()) if num_tokens is None else num_tokens
    plan, prop = method.kv_plan(layout, lengths), method.propagation(layout, lengths)
    if prop is not None:
        prop.begin(num_tokens, device)
    if prop is not None and prop.restart:
        if archive is not None:
            raise ValueError(f"{method.name} re-encodes only the tokens it keeps, so nothing it drops has entries to "
                             "archive; use archive=None or a method that evicts entries")
        return MethodPass(method, plan, prop, None)
    budgets = [max(plan[i]) if i in plan else num_tokens for i in range(layout.num_layers)]
    cache = BudgetedKVCache.for_model(layout, len(lengths), budgets, room, dtype, device, num_kv_heads, head_dim,
                                      kv_dtype)
    cache.archive_kind = archive
    return MethodPass(method, plan, prop, method.retention(plan, cache))


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


def layer_steps(members, prop, view, account=None) -> torch.Tensor | None:
    """The per-layer sequence of every prefill, for the methods of one lane (they compute the same
    tokens): each method's store keeps the layer's entries, the propagation sees the layer, each
    store then sees the propagation (a guided retention selects its held layers once a guide
    exists). Returns the kept token indices (B, K) when the propagation fires here. `members`:
    objects with a `store` (a `Retention`, or None when the propagation restarts); `account`: what
    times each step (the shared pass's `_LaneAccount`), None: untimed."""
    account = account or UNTIMED
    for m in members:
        with account.store(m, view):
            if m.store is not None:
                m.store.layer(view)
    if prop is None:
        return None
    with account.propagation(members, prop):
        kept = prop.after_layer(view)
    if not prop.restart:
        for m in members:
            if m.store is not None:
                with account.selection(m):
                    m.store.after_propagation(prop)
    return kept


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


class _LaneAccount:
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


def plan_method(model, method: Method, lengths, num_tokens: int, room: int, archive: str | None = None) -> _Target:
    """`prepare` on the model's config, as a target of the shared pass."""
    cfg = model.config
    p = prepare(method, cfg, lengths, cfg.num_kv_heads, cfg.head_dim, room, model.dtype, model.device, num_tokens,
                model.kv_dtype, archive)
    return _Target(p.method, p.plan, p.prop, p.store)


def check_scorable(cfg) -> None:
    if not cfg.full_attention_layers:
        raise ValueError("the model has no full-attention layer to score; compression needs one")


@torch.inference_mode()
def compress(model, tokens: torch.Tensor, positions: torch.Tensor, method: Method | None = None,
             room: int = 256, compile=False, timer: Timer = NO_TIMER, archive: str | None = None,
             block=None) -> CompressedState:
    """Prefill `tokens` (B, S) at `positions` (B, S) (-1 = left padding) with `method`.

    `room`: cache slots after the kept entries for tokens appended later (generation, questions).
    `compile`: False (eager), True (inductor) or a backend: each layer block runs compiled with a
    dynamic length. `timer`: a `structkv.util.timing.Timer` to fill the phase times of the stats.
    `archive`: also keep every evicted entry, in this kind ("int4", "int8", "bf16", "float"), as
    the state's `archive`, so a question can recall them (`structkv.generate(..., recall=...)`).
    `block`: how each layer runs (`Decoder.run`'s `block`, e.g. `structkv.models.sliced.sliced_block`,
    which makes way for other work between slices); it replaces `compile`'s.
    """
    return compress_shared(model, tokens, positions, [method], room, compile, timer=timer, archive=archive,
                           block=block)[0]


@torch.inference_mode()
def compress_shared(model, tokens: torch.Tensor, positions: torch.Tensor, methods: list[Method],
                    room: int = 256, compile=False, timer: Timer | None = None, observe=None,
                    archive: str | None = None, block=None) -> list[CompressedState]:
    """Compress `tokens` (B, S) at `positions` with every method of `methods` in one pass; the
    states come back in the order of `methods`. `timer`: phase timer (default: one, so each
    method's share can be told); `observe(view)`: called with every layer's `LayerView` of the
    first stream (calibration reads the pivot statistics there); `archive`: see `compress`
    (every state keeps its own evicted entries), or a list with one kind (or None) per method;
    `block`: see `compress`."""
    from ..models.archive import check_kind

    methods = [m or Full() for m in methods]
    if not methods:
        raise ValueError("compress_shared needs at least one method")
    check_scorable(model.config)
    kinds = list(archive) if isinstance(archive, (list, tuple)) else [archive] * len(methods)
    if len(kinds) != len(methods):
        raise ValueError(f"archive: give one kind or one per method ({len(methods)}), got {len(kinds)}")
    for kind in kinds:
        check_kind(kind)
    if any(kinds) and getattr(model, "tp", None) is not None:
        raise ValueError("an archive (ask-time recall) is not supported under tensor parallelism yet; use archive=None")
    timer = Timer() if timer is None else timer
    groups: dict[str | None, list[int]] = {}  # methods with one probe run on the same tokens
    for i, m in enumerate(methods):
        groups.setdefault(probing.probe_of(m), []).append(i)
    out = [None] * len(methods)
    for text, index in groups.items():
        group, archives = [methods[i] for i in index], [kinds[i] for i in index]
        if text is None:
            states = _compress(model, tokens, positions, group, room, compile, timer, observe, archive=archives,
                               block=block)
        else:
            ids = probing.probe_ids(model, text)
            ext, ext_pos = probing.extend(tokens, positions, ids)
            states = _compress(model, ext, ext_pos, [probing.widened(m, len(ids)) for m in group], room, compile,
                               timer, observe, probe=len(ids), archive=archives, block=block)
        for i, method, state in zip(index, group, states):
            state.method, out[i] = method, state
    return out


def _compress(model, tokens, positions, methods, room, compile, timer, observe, probe: int = 0, archive=None,
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
    account = _LaneAccount(ledger.timer, {("window", window)} if window else set())
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
        target.state = compress(model, ids, positions, Full(), room, compile)
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


def prefill(model, context=None, method: Method | None = None, *, messages=None, room: int = 256,
            compile=False, archive: str | None = None, recall=None, archive_dir=None, block=None) -> CompressedState:
    """Compress once, ask many: prefill `context` (text, ids or a batch) with `method` and return
    a reusable `CompressedState`; pass it to `structkv.generate(model, question, state=...)`.
    `messages` instead of `context`: a conversation rendered by the model's chat template (e.g. a
    user turn holding a long document); later turns go to `generate(messages=..., state=...)`.

    Ask-time recall: `archive` ("int4", "int8", "bf16" or "float") keeps what the method evicted,
    stored small, and every question then recalls `recall` entries per archived layer (a ratio of
    the context or a count; default `structkv.modules.recall.DEFAULT_RECALL`) chosen by its own
    attention (`structkv.modules.recall`). `archive_dir`: the archive goes to a file there
    (read and checked at each question; RAM then holds only the hot set). `block`: see `compress`."""
    from ..modules.budget import Budget
    from ..modules.recall import DEFAULT_RECALL

    if isinstance(method, str):
        from ..methods import get

        method = get(method)
    if archive is None and (recall is not None or archive_dir is not None):
        raise ValueError("recall= and archive_dir= need an archive of the evicted entries: pass archive='int4' "
                         "(or 'int8', 'bf16', 'float')")
    if recall is not None:
        recall = Budget.parse(recall, "recall").value
    if (context is None) == (messages is None):
        raise ValueError("give the context either as `context` (text or ids) or as chat `messages`")
    if messages is not None:
        from ..text.chat import encode as encode_chat

        context = encode_chat(_tokenizer(model), messages, add_generation_prompt=False)
    tokens, positions, _ = encode_batch(model, context if is_batch(context) else [context])
    state = compress(model, tokens, positions, method, room=room, compile=compile, archive=archive, block=block)
    state.messages = list(messages) if messages is not None else None
    if state.archive is not None:
        state.recall = DEFAULT_RECALL if recall is None else recall
        if archive_dir is not None:
            import uuid
            from pathlib import Path

            state.archive = state.archive.save(Path(archive_dir) / f"{uuid.uuid4().hex}.safetensors")
    return state


def _tokenizer(model):
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: chat messages need one (tokenizer.json in its folder)")
    return model.tokenizer


def prefill_stats(model, method, lengths, processed, cache, prop, prefill_s: float, timer: Timer,
                  extra_pass: dict | None = None) -> PrefillStats:
    """`extra_pass`: tokens and seconds of a store's second pass over the prompt (`Retention.extra_pass`,
    a reconstruction), counted at every layer in `tokens_per_layer` and the prefill fraction: it is
    prefill work."""
    cfg = model.config
    if extra_pass is not None:
        processed = [p + extra_pass["tokens"] for p in processed]
    pivots = prop.pivots if prop is not None else [None] * len(lengths)
    kept = cache.nbytes()
    totals = timer.totals if timer.enabled else None
    prompt = lengths.tolist()
    return PrefillStats(
        method=method.name, prompt_tokens=prompt, tokens_per_layer=processed,
        prefill_fraction=sum(processed) / (cfg.num_layers * sum(prompt)),
        pivot_layer=pivots if len(pivots) > 1 else pivots[0], kv_entries_per_layer=cache.entries(),
        kv_bytes_per_layer=kept, kv_bytes_allocated_per_layer=cache.nbytes(used=False),
        kv_bytes_full_layers=sum(kept[i] for i in cfg.full_attention_layers), prefill_s=prefill_s,
        host_syncs=prop.host_syncs if prop is not None else 0,
        reconstruction_tokens=extra_pass["tokens"] if extra_pass else None,
        reconstruction_s=extra_pass["seconds"] if extra_pass else None,
        scoring_s=totals["scoring"] if totals else None,
        selection_s=totals["selection"] + totals["propagation"] if totals else None,
        cache_fill_s=totals["cache_fill"] if totals else None,
        **_tp_stats(model, kept), **(prop.stats() if prop is not None else {}))


def _tp_stats(model, kept: list[int]) -> dict:
    """Under tensor parallelism: the ranks and the kept bytes of all of them (one all-reduce)."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return {}
    total = tp.all_reduce(torch.tensor([sum(kept)], dtype=torch.float64, device=model.device))
    return {"tp_ranks": tp.world, "kv_bytes_all_ranks": int(total.item())}


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
