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


def _pooled(sal: torch.Tensor, method: Method) -> torch.Tensor:
    """Saliency pooled over the non-window tokens (B, H, n); window columns 0 (they are forced)."""
    n, w = sal.shape[-1], method.window
    out = torch.zeros_like(sal)
    out[:, :, : n - w] = pool_scores(sal[:, :, : n - w], method.kernel, method.pooling)
    return out


def _kv_scores(method: Method, sal: torch.Tensor, q, k, pos, valid, cfg) -> torch.Tensor:
    """Scores (B, H, n), H = Hkv (per head) or 1 (shared), higher = keep."""
    B, Hkv, n = sal.shape if sal is not None else (k.shape[0], k.shape[1], k.shape[2])
    if isinstance(method, StreamingLLM):
        rank = valid.long().cumsum(1) - 1  # (B, n) index among real tokens
        score = torch.where(rank < method.sinks, torch.full_like(pos, 1 << 40), pos).float()
        return score[:, None]
    if isinstance(method, H2O):
        total = torch.zeros(B, Hkv, n, device=k.device)
        for s in range(0, n, H2O_QUERY_BLOCK):  # attention received from every prompt query
            blk = slice(s, min(s + H2O_QUERY_BLOCK, n))
            part, _ = window_scores(q[:, :, blk], k, pos[:, blk].contiguous(), pos, scale=cfg.scale)
            total += part * (blk.stop - blk.start)
        scores = total
    else:
        scores = _pooled(sal, method)
    if not getattr(method, "per_head", True):
        scores = scores.sum(1, keepdim=True)
    return scores


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
    """One method's share of a (possibly shared) prefill: its per-layer budgets, cache and own time."""

    method: Method
    layer_keep: dict[int, list[int]]
    cache: BudgetedKVCache
    own: dict = field(default_factory=lambda: {"scoring_s": 0.0, "selection_s": 0.0, "cache_fill_s": 0.0})


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
    """One prefill pass for several methods that compute the same hidden states (equal
    `prefill_key`: full, StreamingLLM, SnapKV, PyramidKV and H2O at any budgets; FastKV or StructKV
    at several KV budgets). Each fills its own cache from its own selection, so each state equals
    `compress(method)` alone. Timings: a state's `prefill_s` is the pass minus the other methods'
    own work (their selection, cache fill and method-specific scoring).
    """
    methods = [m or Full() for m in methods]
    if not methods:
        raise ValueError("compress_shared needs at least one method")
    if len({m.prefill_key() for m in methods}) != 1:
        raise ValueError(f"methods {[m.name for m in methods]} do not share a prefill (different prefill_key); "
                         "compress them separately")
    lead = methods[0]  # its propagation (FastKV, StructKV, GemFilter) is every method's
    cfg = model.config
    B, S = tokens.shape
    L, scored = cfg.num_layers, cfg.full_attention_layers
    if not scored:
        raise ValueError("the model has no full-attention layer to score; compression needs one")
    valid = positions >= 0
    lengths = valid.sum(1)
    block_fn = run_block if not compile else compiled_block("inductor" if compile is True else compile)
    t0 = clock()
    timers = {"scoring_s": 0.0, "selection_s": 0.0, "cache_fill_s": 0.0}  # shared work

    # ---------------------------------------------------------------- plan (host, once)
    targets = []
    for m in methods:
        kv_keep = m.kv_keep(lengths) if m.compresses_kv else None
        layer_keep = {i: m.layer_keep(i, cfg, lengths, kv_keep) for i in scored} if kv_keep else {}
        budgets = [max(layer_keep[i]) if i in layer_keep else S for i in range(L)]
        targets.append(_Target(m, layer_keep, BudgetedKVCache(cfg, B, budgets, room, model.dtype, model.device)))
    tsp_layer = resolve_layer(lead.tsp_layer, cfg, scored, "tsp_layer") if isinstance(lead, FastKV) else None
    gem_layer = resolve_layer(lead.filter_layer, cfg, scored, "filter_layer") if isinstance(lead, GemFilter) else None
    tracker = detector = fixed_pivot = None
    struct_keep = tsp_keep = gem_keep = None
    if isinstance(lead, StructKV):
        struct_keep = budget_tokens(lead.r_struct, lengths, "structkv r_struct")
        lead._check_window(struct_keep, lengths, "r_struct")
        tracker = CentralityTracker(lead.decay)
        tracker.reset(B, S, device=tokens.device)
        if lead.pivot == "dynamic":
            ratio = lead.r_struct if isinstance(lead.r_struct, float) else lead.r_struct / max(lengths.tolist())
            detector = PivotDetector(L, scored, lead.depth_range, lead.weights, topk_ratio=ratio)
            detector.reset(B)
        else:
            fixed_pivot = resolve_layer(lead.pivot, cfg, scored, "pivot")
    if isinstance(lead, FastKV):
        tsp_keep = budget_tokens(lead.tsp_rate, lengths, "fastkv tsp_rate")
        lead._check_window(tsp_keep, lengths, "tsp_rate")
    if isinstance(lead, GemFilter):
        gem_keep = budget_tokens(lead.kv_budget, lengths, "gemfilter kv_budget")
    pruner = SkeletonPruner(getattr(lead, "window", 0))

    # ---------------------------------------------------------------- the layer loop
    h = model.embed(tokens)
    pos = positions.clone()  # an inference tensor like every later one: no recompile after propagation
    cols = torch.arange(S, device=tokens.device).expand(B, S)  # original column of each token
    rope = model.rope_tables(pos)
    processed: list[int] = []
    pivots: list[int | None] = [None] * B
    for i in range(L):
        valid = pos >= 0
        processed.append(int(valid.sum()))
        cos, sin = rope[cfg.layer_types[i]]
        if block_fn is not run_block:  # one compile for every length: mark the token dimension dynamic
            for t, dim in ((h, 1), (pos, 1), (cos, 2), (sin, 2)):
                torch._dynamo.mark_dynamic(t, dim, min=2, max=cfg.max_position_embeddings)
        h, q, k, v = block_fn(model.model.layers[i], h, pos, cos, sin)
        n = h.shape[1]

        # observation-window saliency, once per window size that someone at this layer needs
        centrality_open = tracker is not None and any(p is None for p in pivots)
        windows = {t.method.window for t in targets if t.method.needs_scores and i in t.layer_keep}
        if lead.needs_scores and i in scored and (centrality_open or i == tsp_layer):
            windows.add(lead.window)
        window_sal = {}
        for w in sorted(windows):
            t = clock()
            window_sal[w] = window_scores(q[:, :, n - w:], k, pos[:, n - w:].contiguous(), pos, scale=cfg.scale)
            timers["scoring_s"] += clock() - t

        for target in targets:  # each method's own cache
            m, own = target.method, target.own
            t = clock()
            idx = None
            if i in target.layer_keep:
                sal = window_sal.get(m.window, (None, None))[0]
                scores = _kv_scores(m, sal, q, k, pos, valid, cfg)
                idx = select_tokens(scores, valid, target.layer_keep[i], m.window)
                idx = idx.expand(B, k.shape[1], -1) if idx.shape[1] == 1 else idx
            own["selection_s"] += clock() - t
            t = clock()
            target.cache.fill(i, k, v, pos, idx)
            own["cache_fill_s"] += clock() - t
        t = clock()

        sal, ent = window_sal.get(getattr(lead, "window", None), (None, None))
        stats_s = 0.0  # pivot statistics: counted as scoring, not selection
        keep_rows = None  # per-row token counts to keep after this layer (None: no propagation)
        if i == tsp_layer:
            score = _pooled(sal, lead).sum(1)  # (B, n)
            keep_rows = tsp_keep
            pivots = [i] * B
        if tracker is not None and centrality_open and i in scored:
            w = lead.window
            s = _pooled(sal, lead).sum(1) / w  # (B, n), S^(l); the window is forced in, never ranked
            tracker.update(s, cols, layer=i)
            if detector is not None:
                t_s = clock()
                n_vis = ((pos[:, None, :] >= 0) & (pos[:, None, :] <= pos[:, n - w:, None])).sum(-1)  # (B, w)
                stats = PivotDetector.statistics(sal, ent, n_vis, valid, detector.topk_ratio)
                fired = detector.observe(i, stats)
                stats_s = clock() - t_s
                timers["scoring_s"] += stats_s
            else:
                fired = [i == fixed_pivot] * B
            if any(fired):
                score = tracker.current(cols)
                keep_rows = [struct_keep[b] if fired[b] else n for b in range(B)]
                pivots = [i if fired[b] else pivots[b] for b in range(B)]
        if keep_rows is not None:
            idx = pruner.select(score, valid, keep_rows)  # (B, K)
            h, cols, pos = pruner.gather(idx, h, cols, positions=pos)
            rope = model.rope_tables(pos)
        timers["selection_s"] += clock() - t - stats_s

        if i == gem_layer:  # GemFilter: pick tokens, renumber, restart the whole model on them
            t = clock()
            score = _gemfilter_scores(q, k, valid, lead.kernel)
            idx = SkeletonPruner(0, positions="compact").select(score, valid, gem_keep)
            new_cols = gather_tokens(cols, idx)
            new_tokens = torch.where(idx >= 0, tokens.gather(1, new_cols), torch.zeros_like(new_cols))
            new_pos = torch.where(idx >= 0, (idx >= 0).long().cumsum(1) - 1, torch.full_like(idx, -1))
            timers["selection_s"] += clock() - t
            rerun = compress(model, new_tokens, new_pos, Full(), room, compile=compile)
            stats = _stats(model, lead, lengths, processed + rerun.stats["tokens_per_layer"], rerun.cache,
                           [gem_layer] * B, None, timers, clock() - t0, syncs=1)
            return [CompressedState(rerun.cache, rerun.logits, rerun.next_positions, lengths.tolist(), lead, stats,
                                    torch.where(idx >= 0, new_cols, torch.full_like(idx, -1)))]

    logits = model.logits(h[:, -1])
    next_positions = pos.max(dim=1, keepdim=True).values + 1  # (B, 1)
    syncs = (detector.host_syncs if detector else 0) + (1 if tsp_layer is not None or fixed_pivot is not None else 0)
    kept = torch.where(pos >= 0, cols, torch.full_like(cols, -1))
    elapsed = clock() - t0
    own_total = [sum(t.own.values()) for t in targets]
    states = []
    for j, target in enumerate(targets):
        mine = {k: timers[k] + target.own[k] for k in timers}
        alone = elapsed - (sum(own_total) - own_total[j])  # the pass without the other methods' own work
        stats = _stats(model, target.method, lengths, processed, target.cache, pivots, detector, mine, alone, syncs)
        if len(targets) > 1:
            stats["shared_prefill"] = {"methods": len(targets), "pass_s": elapsed}
        if tracker is not None:
            stats["centrality_layers"] = tracker.layers
        states.append(CompressedState(target.cache, logits, next_positions, lengths.tolist(), target.method, stats,
                                      kept))
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
