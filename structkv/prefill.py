"""Compressed prefill: one loop over layers that scores, fills budgeted caches and propagates tokens.

Per layer l (each layer block eager or compiled with a dynamic length; scoring, selection and the
pivot decision run on the host between blocks; the pivot decisions are counted in `stats["host_syncs"]`):
1. q, k, v of the current tokens (original positions), attention, MLP;
2. at full-attention layers, when the method needs it, `window_scores` of the last w queries;
3. the layer's cache: its own selection of `kv_budget` entries per KV head (`compact_kv`), all
   entries (full), or the exact window ring (sliding layers of hybrid models);
4. token propagation: FastKV at its TSP layer, StructKV at each row's pivot (skeleton by global
   centrality); GemFilter instead restarts the whole model on its selected tokens.
Deeper layers then really compute on fewer tokens: that is the prefill saving, reported as the
fraction of token-layers computed.

Hybrid models (Gemma 3): sliding-window layers cannot see far tokens, so they are never scored,
contribute nothing to centrality or pivot statistics, and keep their exact window; budgets,
saliency, centrality and the pivot live on the full-attention layers.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .methods import FastKV, Full, GemFilter, H2O, Method, StreamingLLM, StructKV
from .methods.base import resolve_layer
from .models.decoder import run_block
from .modules import (BudgetedKVCache, CentralityTracker, PivotDetector, SkeletonPruner, budget_tokens,
                      gather_tokens, pool_scores, select_tokens)
from .ops import window_scores


def clock() -> float:
    """Wall time after the GPU has finished its queued work, so phase timers mean something on CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


H2O_QUERY_BLOCK = 1024


@dataclass
class CompressedState:
    """A prompt compressed once: the cache, the last logits and where positions continue."""

    cache: BudgetedKVCache
    logits: torch.Tensor  # (B, V) float32, next-token logits after the prompt
    next_positions: torch.Tensor  # (B, 1) position of the next token per row
    lengths: list[int]  # prompt tokens per row
    method: Method
    stats: dict = field(default_factory=dict)
    kept_columns: torch.Tensor | None = None  # (B, K) prompt columns that reached the last layer, -1 = pad
    source: object = None  # weakref to the model that made it: a state only makes sense on that model

    def check_model(self, model) -> None:
        """Refuse to extend this state with a model other than the one that made it."""
        if self.source is not None and self.source() is not model:
            raise ValueError("this compressed state was made by another model; call model.prefill(context, method) "
                             "with the model you generate with")


def _pooled(sal: torch.Tensor, method: Method) -> torch.Tensor:
    """Saliency pooled over the non-window tokens (B, H, n); window columns 0 (they are forced)."""
    n, w = sal.shape[-1], method.window
    out = torch.zeros_like(sal)
    out[:, :, : n - w] = pool_scores(sal[:, :, : n - w], method.kernel, method.pooling)
    return out


def _kv_scores(method: Method, raw: torch.Tensor | None, pos, valid) -> torch.Tensor:
    """Scores (B, H, n), H = Hkv (per head) or 1 (shared), higher = keep. `raw`: the window
    saliency (B, Hkv, n), or for H2O the attention received from every prompt query."""
    if isinstance(method, StreamingLLM):
        rank = valid.long().cumsum(1) - 1  # (B, n) index among real tokens
        score = torch.where(rank < method.sinks, torch.full_like(pos, 1 << 40), pos).float()
        return score[:, None]
    scores = raw if isinstance(method, H2O) else _pooled(raw, method)
    if not getattr(method, "per_head", True):
        scores = scores.sum(1, keepdim=True)
    return scores


def received_attention(q, k, pos, scale: float, block: int = H2O_QUERY_BLOCK) -> torch.Tensor:
    """H2O's score: the attention each key receives from every prompt query, summed over the
    query heads of its KV group: (B, Hkv, n) from q (B, Hq, n, D), k (B, Hkv, n, D), pos (B, n).
    Queries go in blocks; columns are in position order, so block s..e-1 only reads keys < e
    (half the work of scoring every block against every key)."""
    n = k.shape[2]
    out = torch.zeros(k.shape[0], k.shape[1], n, device=k.device)
    for s in range(0, n, block):
        e = min(s + block, n)
        part, _ = window_scores(q[:, :, s:e], k[:, :, :e], pos[:, s:e].contiguous(), pos[:, :e].contiguous(),
                                scale=scale)
        out[:, :, :e] += part * (e - s)  # window_scores averages over the block's queries
    return out


def _gemfilter_scores(q, k, valid, kernel: int) -> torch.Tensor:
    """Raw (unscaled, no softmax) last-query logits summed over heads, avg-pooled: (B, n)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    q_last = q[:, :, -1].reshape(B, Hkv, Hq // Hkv, D).float()  # (B, Hkv, G, D)
    z = torch.einsum("bhgd,bhnd->bn", q_last, k.float())  # (B, n)
    z = torch.where(valid, z, torch.zeros_like(z))
    return F.avg_pool1d(z[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=True)[:, 0, : z.shape[1]]


_COMPILED_BLOCKS: dict = {}


def compiled_block(backend="inductor"):
    """`run_block` compiled once per backend; with a dynamic token count it serves every layer of
    a kind (full / sliding) at every length, before and after propagation."""
    if backend not in _COMPILED_BLOCKS:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED_BLOCKS[backend] = torch.compile(run_block, fullgraph=True, backend=backend)
    return _COMPILED_BLOCKS[backend]


@dataclass
class _Target:
    """One method's share of a (possibly shared) prefill: its per-layer budgets, cache and the time
    of the work it needed (shared work counted in full: what it would have cost alone)."""

    method: Method
    layer_keep: dict[int, list[int]]
    cache: BudgetedKVCache | None  # None for GemFilter: its cache comes from the restart
    own: dict = field(default_factory=lambda: {"scoring_s": 0.0, "selection_s": 0.0, "cache_fill_s": 0.0})
    other_s: float = 0.0  # embedding, layer blocks, logits


@dataclass
class _Stream:
    """The tokens still computed and their hidden states; lanes share one until a lane propagates."""

    h: torch.Tensor  # (B, n, E)
    pos: torch.Tensor  # (B, n) original positions, -1 = padding
    cols: torch.Tensor  # (B, n) original prompt column of each token
    rope: dict
    qkv: tuple = ()  # the current layer's (q, k, v)


class _Lane:
    """Methods with one `prefill_key`: they propagate the same tokens, by the first one's rule."""

    def __init__(self, model, targets: list[_Target], stream: _Stream, lengths: torch.Tensor, S: int):
        cfg, B = model.config, len(lengths)
        scored = self.scored = cfg.full_attention_layers
        lead = self.lead = targets[0].method
        self.targets, self.stream = targets, stream
        self.processed: list[int] = []  # tokens computed per layer
        self.pivots: list[int | None] = [None] * B
        self.states: list[CompressedState] | None = None  # set when the lane finishes early (GemFilter)
        self.tsp_layer = resolve_layer(lead.tsp_layer, cfg, scored, "tsp_layer") if isinstance(lead, FastKV) else None
        self.gem_layer = (resolve_layer(lead.filter_layer, cfg, scored, "filter_layer")
                          if isinstance(lead, GemFilter) else None)
        self.tracker = self.detector = self.fixed_pivot = None
        if isinstance(lead, StructKV):
            self.keep = lead.fit_window(budget_tokens(lead.r_struct, lengths, "structkv r_struct"), lengths)
            self.tracker = CentralityTracker(lead.decay)
            self.tracker.reset(B, S, device=stream.h.device)
            if lead.pivot == "dynamic":
                ratio = lead.r_struct if isinstance(lead.r_struct, float) else lead.r_struct / max(lengths.tolist())
                self.detector = PivotDetector(cfg.num_layers, scored, lead.depth_range, lead.weights, topk_ratio=ratio)
                self.detector.reset(B)
            else:
                self.fixed_pivot = resolve_layer(lead.pivot, cfg, scored, "pivot")
        if isinstance(lead, FastKV):
            self.keep = lead.fit_window(budget_tokens(lead.tsp_rate, lengths, "fastkv tsp_rate"), lengths)
        if isinstance(lead, GemFilter):
            self.keep = budget_tokens(lead.kv_budget, lengths, "gemfilter kv_budget")
        self.pruner = SkeletonPruner(getattr(lead, "window", 0))

    def centrality_open(self) -> bool:
        """StructKV rows whose pivot has not fired yet still accumulate centrality."""
        return self.tracker is not None and any(p is None for p in self.pivots)

    def needs_window(self, layer: int) -> bool:
        """Does the propagation rule read the window scores of this layer?"""
        return (self.lead.needs_scores and layer in self.scored
                and (self.centrality_open() or layer == self.tsp_layer))

    def propagate(self, model, layer: int, sal, ent) -> float:
        """FastKV's TSP or StructKV's skeleton after `layer`: a new stream of the kept tokens.
        Returns the seconds spent on pivot statistics (scoring, not selection)."""
        st, lead, B = self.stream, self.lead, len(self.pivots)
        n, valid = st.h.shape[1], st.pos >= 0
        stats_s, keep_rows = 0.0, None  # keep_rows: per-row token counts to keep (None: no propagation)
        if layer == self.tsp_layer:
            score = _pooled(sal, lead).sum(1)  # (B, n)
            keep_rows, self.pivots = self.keep, [layer] * B
        if self.centrality_open() and layer in self.scored:
            w = lead.window
            self.tracker.update(_pooled(sal, lead).sum(1) / w, st.cols, layer=layer)  # S^(l); window forced, not ranked
            if self.detector is not None:
                t = clock()
                n_vis = ((st.pos[:, None, :] >= 0) & (st.pos[:, None, :] <= st.pos[:, n - w:, None])).sum(-1)  # (B, w)
                stats = PivotDetector.statistics(sal, ent, n_vis, valid, self.detector.topk_ratio)
                fired = self.detector.observe(layer, stats)
                stats_s = clock() - t
            else:
                fired = [layer == self.fixed_pivot] * B
            if any(fired):
                score = self.tracker.current(st.cols)
                keep_rows = [self.keep[b] if fired[b] else n for b in range(B)]
                self.pivots = [layer if fired[b] else self.pivots[b] for b in range(B)]
        if keep_rows is not None:
            idx = self.pruner.select(score, valid, keep_rows)  # (B, K)
            h, cols, pos = self.pruner.gather(idx, st.h, st.cols, positions=st.pos)
            self.stream = _Stream(h, pos, cols, model.rope_tables(pos))
        return stats_s

    def syncs(self) -> int:
        fixed = self.tsp_layer is not None or self.fixed_pivot is not None or self.gem_layer is not None
        return (self.detector.host_syncs if self.detector else 0) + (1 if fixed else 0)


@torch.inference_mode()
def compress(model, tokens: torch.Tensor, positions: torch.Tensor, method: Method | None = None,
             room: int = 256, compile=False) -> CompressedState:
    """Prefill `tokens` (B, S) at `positions` (B, S) (-1 = left padding) with `method`.

    `compile`: False (eager), True (inductor) or a backend: each layer block runs compiled with a
    dynamic length; scoring, selection and the pivot decision stay on the host between blocks.

    `room`: cache slots left after the kept entries for tokens appended later (generation, questions).
    """
    return compress_shared(model, tokens, positions, [method or Full()], room, compile)[0]


@torch.inference_mode()
def compress_shared(model, tokens: torch.Tensor, positions: torch.Tensor, methods: list[Method],
                    room: int = 256, compile=False) -> list[CompressedState]:
    """One prefill for any mix of methods; each state equals `compress(method)` alone.

    Methods with equal `prefill_key` form a lane: they compute the same hidden states to the last
    layer (full, StreamingLLM, SnapKV, PyramidKV, H2O at any budgets; FastKV or StructKV at several
    KV budgets) and differ only in what each layer's cache keeps. All lanes share one stream of
    hidden states until a lane propagates (FastKV's TSP layer, StructKV's pivot, GemFilter's
    restart) and goes on with its own tokens. Scores are computed once per stream and layer.

    Timings: a state's `prefill_s` is the work its method needed, shared work counted in full (what
    it would have cost alone); `stats["shared_prefill"]["pass_s"]` is the whole pass.
    """
    methods = [m or Full() for m in methods]
    if not methods:
        raise ValueError("compress_shared needs at least one method")
    cfg = model.config
    B, S = tokens.shape
    L, scored = cfg.num_layers, cfg.full_attention_layers
    if not scored:
        raise ValueError("the model has no full-attention layer to score; compression needs one")
    lengths = (positions >= 0).sum(1)
    block_fn = run_block if not compile else compiled_block("inductor" if compile is True else compile)
    t0 = clock()

    # ---------------------------------------------------------------- plan (host, once)
    targets = []
    for m in methods:
        kv_keep = m.kv_keep(lengths) if m.compresses_kv else None
        layer_keep = {i: m.layer_keep(i, cfg, lengths, kv_keep) for i in scored} if kv_keep else {}
        budgets = [max(layer_keep[i]) if i in layer_keep else S for i in range(L)]
        cache = None if isinstance(m, GemFilter) else BudgetedKVCache(cfg, B, budgets, room, model.dtype, model.device)
        targets.append(_Target(m, layer_keep, cache))
    pos = positions.clone()  # an inference tensor like every later one: no recompile after propagation
    trunk = _Stream(model.embed(tokens), pos, torch.arange(S, device=tokens.device).expand(B, S), model.rope_tables(pos))
    groups: dict[tuple, list[_Target]] = {}
    for target in targets:
        groups.setdefault(target.method.prefill_key(), []).append(target)
    lanes = [_Lane(model, members, trunk, lengths, S) for members in groups.values()]
    accounted = clock() - t0  # every timed piece once; the rest (host overhead) is charged to everyone
    for target in targets:
        target.other_s += accounted

    # ---------------------------------------------------------------- the layer loop
    for i in range(L):
        active = [lane for lane in lanes if lane.states is None]
        if not active:
            break
        for st in {id(lane.stream): lane.stream for lane in active}.values():  # one block per stream
            t = clock()
            cos, sin = st.rope[cfg.layer_types[i]]
            if block_fn is not run_block:  # one compile for every length: mark the token dimension dynamic
                for x, dim in ((st.h, 1), (st.pos, 1), (cos, 2), (sin, 2)):
                    torch._dynamo.mark_dynamic(x, dim, min=2, max=cfg.max_position_embeddings)
            st.h, *qkv = block_fn(model.model.layers[i], st.h, st.pos, cos, sin)
            st.qkv = tuple(qkv)
            spent = clock() - t
            accounted += spent
            for target in (t for lane in active if lane.stream is st for t in lane.targets):
                target.other_s += spent

        memo: dict[tuple, tuple] = {}  # (stream id, window or "h2o") -> (scores, seconds)

        def scores(st: _Stream, what):
            """Window scores (saliency, entropy) of the last `what` queries, or H2O's attention
            received from every query: computed once per stream and layer."""
            nonlocal accounted
            if (id(st), what) not in memo:
                t = clock()
                q, k, _ = st.qkv
                n = k.shape[2]
                if what == "h2o":
                    out = received_attention(q, k, st.pos, cfg.scale)
                else:
                    out = window_scores(q[:, :, n - what:], k, st.pos[:, n - what:].contiguous(), st.pos,
                                        scale=cfg.scale)
                memo[id(st), what] = (out, clock() - t)
                accounted += memo[id(st), what][1]
            return memo[id(st), what][0]

        for lane in active:
            st, lead = lane.stream, lane.lead
            q, k, v = st.qkv
            valid = st.pos >= 0
            lane.processed.append(int(valid.sum()))
            lane_needs = {(id(st), lead.window)} if lane.needs_window(i) else set()
            sal, ent = scores(st, lead.window) if lane_needs else (None, None)
            for target in lane.targets:  # each method's own cache
                m, own = target.method, target.own
                needs = set(lane_needs)
                idx = None
                if i in target.layer_keep:
                    raw = None
                    if m.needs_scores:
                        what = "h2o" if isinstance(m, H2O) else m.window
                        raw = scores(st, what)
                        raw = raw if what == "h2o" else raw[0]
                        needs.add((id(st), what))
                    t = clock()
                    idx = select_tokens(_kv_scores(m, raw, st.pos, valid), valid, target.layer_keep[i], m.window)
                    idx = idx.expand(B, k.shape[1], -1) if idx.shape[1] == 1 else idx
                    spent = clock() - t
                    own["selection_s"] += spent
                    accounted += spent
                own["scoring_s"] += sum(memo[key][1] for key in needs)
                if target.cache is not None:
                    t = clock()
                    target.cache.fill(i, k, v, st.pos, idx)
                    spent = clock() - t
                    own["cache_fill_s"] += spent
                    accounted += spent

            t = clock()
            stats_s, rerun_s = lane.propagate(model, i, sal, ent), 0.0
            if i == lane.gem_layer:  # GemFilter: pick tokens, renumber, restart the whole model on them
                score = _gemfilter_scores(q, k, valid, lead.kernel)
                idx = SkeletonPruner(0, positions="compact").select(score, valid, lane.keep)
                new_cols = gather_tokens(st.cols, idx)
                new_tokens = torch.where(idx >= 0, tokens.gather(1, new_cols), torch.zeros_like(new_cols))
                new_pos = torch.where(idx >= 0, (idx >= 0).long().cumsum(1) - 1, torch.full_like(idx, -1))
                t_rerun = clock()
                rerun = compress(model, new_tokens, new_pos, Full(), room, compile=compile)
                rerun_s = clock() - t_rerun
                (target,) = lane.targets  # a GemFilter's key is its own
                target.other_s += rerun_s
                lane.pivots = [i] * B
                lane.processed += rerun.stats["tokens_per_layer"]
                target.cache = rerun.cache
                lane.states = [CompressedState(rerun.cache, rerun.logits, rerun.next_positions, lengths.tolist(), lead,
                                               {}, torch.where(idx >= 0, new_cols, torch.full_like(idx, -1)))]
            spent = clock() - t
            accounted += spent
            for target in lane.targets:
                target.own["scoring_s"] += stats_s
                target.own["selection_s"] += spent - stats_s - rerun_s

    # ---------------------------------------------------------------- logits, per stream
    finals: dict[int, tuple] = {}
    for lane in (lane for lane in lanes if lane.states is None):
        st = lane.stream
        if id(st) not in finals:
            t = clock()
            kept = torch.where(st.pos >= 0, st.cols, torch.full_like(st.cols, -1))
            finals[id(st)] = (model.logits(st.h[:, -1]), st.pos.max(dim=1, keepdim=True).values + 1, kept,
                              clock() - t)
            accounted += finals[id(st)][3]
        logits, next_positions, kept, spent = finals[id(st)]
        for target in lane.targets:
            target.other_s += spent
        lane.states = [CompressedState(target.cache, logits, next_positions, lengths.tolist(), target.method, {}, kept)
                       for target in lane.targets]

    elapsed = clock() - t0
    overhead = max(elapsed - accounted, 0.0)
    by_target = {}
    for lane in lanes:
        for target, state in zip(lane.targets, lane.states):
            alone = target.other_s + sum(target.own.values()) + overhead
            state.stats = _stats(model, target.method, lengths, lane.processed, target.cache, lane.pivots,
                                 lane.detector, target.own, alone, lane.syncs())
            if len(targets) > 1:
                state.stats["shared_prefill"] = {"methods": len(targets), "lanes": len(lanes), "pass_s": elapsed,
                                                 "untimed_s": overhead}
            if lane.tracker is not None:
                state.stats["centrality_layers"] = lane.tracker.layers
            by_target[id(target)] = state
    states = [by_target[id(target)] for target in targets]
    for state in states:
        state.source = weakref.ref(model)
    return states


def _stats(model, method, lengths, processed, cache, pivots, detector, timers, prefill_s, syncs) -> dict:
    cfg = model.config
    total = cfg.num_layers * int(lengths.sum())
    entries, nbytes = cache.entries(), cache.nbytes()
    out = {
        "method": method.name,
        "prompt_tokens": lengths.tolist(),
        "tokens_per_layer": processed,
        "prefill_fraction": sum(processed) / total,
        "pivot_layer": pivots if len(pivots) > 1 else pivots[0],
        "kv_entries_per_layer": entries,
        "kv_bytes_per_layer": nbytes,
        "kv_bytes": sum(nbytes),
        "kv_bytes_full_layers": sum(nbytes[i] for i in cfg.full_attention_layers),
        "prefill_s": prefill_s,
        "host_syncs": syncs,
        **timers,
    }
    if detector is not None:
        curves = [t.t_curve for t in detector.traces]
        out["t_curve"] = curves if len(curves) > 1 else curves[0]
    return out
