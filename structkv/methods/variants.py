"""The methods, one small dataclass each: defaults follow docs/algorithm.md and docs/methods.md (FastKV's
harness where StructKV is silent)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..modules import (
    FixedLayerPropagation,
    RestartPropagation,
    StructKVCompressor,
    budget_tokens,
    pool_scores,
    pooled_saliency,
)
from ..modules.reconstruction import DEFAULT_PROMPT
from ..modules.retention import ReconstructionRetention
from ..modules.scores import expected_attention
from ..modules.structkv_config import SIGNALS, STRUCTURE, StructKVConfig, Structure
from .base import Method, resolve_layer


@dataclass
class Full(Method):
    """No compression: the reference every method is measured against."""

    name = "full"


@dataclass
class StreamingLLM(Method):
    """Keep `sinks` first tokens plus the most recent ones (FastKV port: at prefill end, original
    positions, no re-rotation)."""

    kv_budget: float | int = 0.1
    sinks: int = 4
    window: int = 8
    name = "streaming_llm"
    compresses_kv = True

    def kv_scores(self, view):
        """The first `sinks` real tokens first, then the most recent (higher position = keep)."""
        pos = view.positions
        rank = view.valid.long().cumsum(1) - 1  # (B, n) index among real tokens
        return torch.where(rank < self.sinks, torch.full_like(pos, 1 << 40), pos).float()[:, None]  # (B, 1, n)


@dataclass
class WindowScored(Method):
    """Shared fields of the methods that keep, per layer, the entries the observation window
    attends to most (FastKV's harness defaults: w 8, max-pool kernel 7, per KV head)."""

    kv_budget: float | int = 0.1
    window: int = 8
    kernel: int = 7
    pooling: str | None = "max"
    per_head: bool = True
    # Scoring options (KV selection only): `observe` queries score the keys while only `window`
    # are forced in (None: the same w); `pool_query_heads` pools each query head's attention
    # before the sum over its KV group, as SnapKV's and FastKV's official code do (default: the
    # group's sum is pooled, one pass over K).
    observe: int | None = None
    pool_query_heads: bool = False
    # Query-agnostic option: a text appended to the context during compression only, whose queries
    # are the observation window (`structkv.runtime.probe`); None: the context's last `window` tokens.
    probe: str | None = None
    compresses_kv = True
    min_window = 1

    def kv_scores(self, view):
        w = self.observe or self.window
        if self.pool_query_heads:
            per_query = view.window_scores_per_query_head(w)  # (B, Hq, n)
            B, Hq, n = per_query.shape
            pooled = pooled_saliency(per_query, self.window, self.kernel, self.pooling)
            Hkv = view.num_kv_heads
            scores = pooled.view(B, Hkv, Hq // Hkv, n).sum(2)  # (B, Hkv, n)
        else:
            saliency = view.window_scores(w)
            scores = pooled_saliency(saliency, self.window, self.kernel, self.pooling)  # (B, Hkv, n)
        return self.heads(scores)

    def validate(self):
        super().validate()
        if self.probe is not None and (not isinstance(self.probe, str) or not self.probe.strip()):
            raise ValueError(f"{self.name}: probe must be a non-empty text or None, got {self.probe!r}")
        o = self.observe
        if o is not None and (isinstance(o, bool) or not isinstance(o, int) or o < max(self.window, 1)):
            raise ValueError(f"{self.name}: observe must be an int >= window ({self.window}) or None, got {o!r}")
        if not isinstance(self.pool_query_heads, bool):
            raise ValueError(f"{self.name}: pool_query_heads must be True or False, got {self.pool_query_heads!r}")


@dataclass
class SnapKV(WindowScored):
    """Per-layer one-shot selection by pooled observation-window attention (full prefill)."""

    name = "snapkv"


@dataclass
class PyramidKV(SnapKV):
    """SnapKV scoring with budgets falling linearly with depth (same total as SnapKV)."""

    beta: float = 20.0
    name = "pyramidkv"

    def validate(self):
        super().validate()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 1 <= self.beta < float("inf"):
            raise ValueError(f"pyramidkv: beta must be a finite number >= 1 (1 = the same budget at every layer, "
                             f"larger = steeper), got {self.beta!r}")

    def layer_keep(self, layer, layout, lengths, base):
        return pyramid_keep(layer, layout, lengths, base, self.beta, self.window)


def pyramid_keep(layer, layout, lengths, base, beta: float, window: int) -> list[int]:
    """kvpress/PyramidKV schedule over the scored layers: max at the first, min at the last, the
    same total as `base` at every layer (beta: max/min ratio of the non-window budgets)."""
    scored = layout.full_attention_layers
    if layer not in scored or len(scored) < 2:
        return base
    j, m = scored.index(layer), len(scored)
    out = []
    for cap, n in zip(base, lengths.tolist()):
        w = min(window, cap)
        lo = (cap - w) / beta
        hi = 2 * (cap - w) - lo
        if hi >= n - w:
            hi = n - w
            lo = 2 * (cap - w) - hi
        out.append(int(round(hi - j * (hi - lo) / (m - 1))) + w)
    return out


@dataclass
class H2O(Method):
    """Heavy hitters: attention received from *all* prompt queries (one-shot, at prefill end)."""

    kv_budget: float | int = 0.1
    window: int = 8
    per_head: bool = True
    name = "h2o"
    compresses_kv = True

    def kv_scores(self, view):
        scores = view.received_attention()  # (B, Hkv, n)
        return self.heads(scores)


@dataclass
class GemFilter(Method):
    """Run layers 0..r, pick tokens by the last query's raw q.k at layer r (avg-pooled, shared by
    heads), then re-run the whole model on the selected tokens with positions renumbered."""

    kv_budget: float | int = 0.1
    filter_layer: float | int = 13 / 32
    kernel: int = 5
    window: int = 0  # the official code forces nothing in
    name = "gemfilter"  # scores with its own raw last-query q.k, not window_scores
    restarts: ClassVar[bool] = True

    def prefill_key(self):
        return ("gemfilter", id(self))  # its re-run depends on kv_budget: never shared

    def propagation(self, layout, lengths):
        layer = resolve_layer(self.filter_layer, layout, layout.full_attention_layers, "filter_layer")
        return RestartPropagation(layer, budget_tokens(self.kv_budget, lengths, "gemfilter kv_budget"), self.kernel)


@dataclass
class FastKV(WindowScored):
    """Token-selective propagation at a fixed layer plus per-layer KV selection."""

    tsp_layer: float | int = 15 / 32
    struct_budget: float | int = 0.2
    name = "fastkv"
    has_struct_budget: ClassVar[bool] = True

    def prefill_key(self):
        return ("fastkv", self.tsp_layer, self.struct_budget, self.window, self.kernel, self.pooling)

    def propagation(self, layout, lengths):
        layer = resolve_layer(self.tsp_layer, layout, layout.full_attention_layers, "tsp_layer")
        keep = self.fit_window(budget_tokens(self.struct_budget, lengths, "fastkv struct_budget"), lengths)
        return FixedLayerPropagation(layer, keep, self.window, self.kernel, self.pooling)


@dataclass
class StructKV(WindowScored, Structure):
    """Global centrality over depth, dynamic pivot, skeleton propagation, decoupled KV budgets.

    The structural options (decay, the detector's settings, skeleton, guide, signal) are declared
    once, in `Structure`, and validated once, in `StructKVConfig`; this class adds the budgets and
    what the method decides before the compressor exists:
    pivot: "dynamic" (detected per row inside depth_range: `PivotDetector`), or a fixed layer
    (int) or depth fraction (float); `structkv.calibrate` fixes it from a few prompts.
    equal_compute: choose the skeleton size at the detected pivot so that the prefill costs what
    FastKV's does (its layer 15/32, rate struct_budget).
    beta: cross-layer KV retention (`GuidedRetention`): every planned layer keeps the top of
    norm(S^(l)) + beta * norm(G), G the guide; beta 0 = each layer by its own scores (the paper).
    pyramid: PyramidKV-shaped per-layer KV budgets with this steepness (None: flat).
    kv_signal: the signal each layer's KV entries are ranked by (None: `signal`, which the
        skeleton and the guide use); e.g. the union's skeleton with each layer's raw novelty.
    """

    # Defaults: the configuration chosen on the development split (docs/methods.md, "StructKV
    # here"); the paper's algorithm is `structkv_paper` (pivot "dynamic", confirm 1, skeleton
    # "centrality", beta 0).
    struct_budget: float | int = 0.2
    pivot: str | float | int = 15 / 32
    equal_compute: bool = False
    beta: float = 3.0
    pyramid: float | None = None
    kv_signal: str | None = None
    name = "structkv"
    has_struct_budget: ClassVar[bool] = True

    def propagation(self, layout, lengths):
        """StructKV's compressor: centrality over the scored layers, the pivot (detected per row or
        fixed), the skeleton of `struct_budget` tokens (or FastKV's compute, `equal_compute`)."""
        scored = layout.full_attention_layers
        keep = self.fit_window(budget_tokens(self.struct_budget, lengths, "structkv struct_budget"), lengths)
        pivot = None if self.pivot == "dynamic" else resolve_layer(self.pivot, layout, scored, "pivot")
        keep_at = self._equal_compute(layout, lengths) if self.equal_compute else None
        return StructKVCompressor(layout.num_layers, scored, keep, self.settings(pivot), keep_at)

    def settings(self, pivot: int | None = None) -> StructKVConfig:
        """The compressor's settings: this method's `Structure` fields and scoring window, with the
        pivot resolved to a layer (None: detected per row); validated there."""
        return StructKVConfig(**{name: getattr(self, name) for name in STRUCTURE}, window=self.window,
                              kernel=self.kernel, pooling=self.pooling, pivot=pivot)

    def _unresolved(self) -> StructKVConfig:
        """The settings before a model resolves a fixed pivot to its layer (0 stands for it)."""
        return self.settings(None if self.pivot == "dynamic" else 0)

    def _equal_compute(self, layout, lengths):
        """layer -> tokens kept per row so that token-layers computed equal FastKV's at its
        default layer with rate struct_budget: (p + 1) n + K (L - p - 1) = (f + 1) n + r n (L - f - 1)."""
        L = layout.num_layers
        f = resolve_layer(FastKV.tsp_layer, layout, layout.full_attention_layers, "tsp_layer")
        base = self.fit_window(budget_tokens(self.struct_budget, lengths, "structkv struct_budget"), lengths)

        def keep_at(p: int) -> list[int]:
            if p >= L - 1:
                return base
            out = []
            for n, k in zip(lengths.tolist(), base):
                budget = (f + 1) * n + k * (L - f - 1) - (p + 1) * n  # token-layers left after the pivot
                out.append(int(min(n, max(min(self.window, n), budget // (L - p - 1)))))
            return out
        return keep_at

    def kv_scores(self, view):
        kind = self.kv_signal or self.signal
        if kind == "window":
            return super().kv_scores(view)  # the observation window's options (observe, per query head)
        signal = view.structure_signal(kind, self.window, self.window_share)  # each layer its own S^(l)
        return self.heads(pooled_saliency(signal, self.window, self.kernel, self.pooling))

    def layer_keep(self, layer, layout, lengths, base):
        return base if self.pyramid is None else pyramid_keep(layer, layout, lengths, base, self.pyramid, self.window)

    def retention(self, plan, cache):
        from ..modules.retention import GuidedRetention, Retention

        return GuidedRetention(self, plan, cache, self.beta) if self.beta else Retention(self, plan, cache)

    def prefill_key(self):
        return ("structkv", self.struct_budget, self.pivot, self.equal_compute, self._unresolved())

    def validate(self):
        super().validate()
        if isinstance(self.pivot, str) and self.pivot != "dynamic":
            hint = (" (a calibrated pivot is a layer: structkv.calibrate(model, prompts, method) returns "
                    "the method with it)") if self.pivot == "calibrated" else ""
            raise ValueError(f"structkv: pivot must be 'dynamic', a layer index or a depth fraction, "
                             f"got {self.pivot!r}{hint}")
        try:
            self._unresolved()  # the compressor's settings, validated in one place
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 0 <= self.beta < math.inf:
            raise ValueError(f"structkv: beta must be a finite number >= 0 (0 = no guided retention), "
                             f"got {self.beta!r}")
        if self.kv_signal is not None and self.kv_signal not in SIGNALS:
            raise ValueError(f"structkv: kv_signal must be None (the skeleton's signal) or one of "
                             f"{', '.join(map(repr, SIGNALS))}, got {self.kv_signal!r}")
        p = self.pyramid
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 1 <= p < math.inf):
            raise ValueError(f"structkv: pyramid must be None or a finite number >= 1 (PyramidKV's beta), got {p!r}")


@dataclass
class KVzip(Method):
    """Query-agnostic: each entry kept by how much the model needs it to repeat its context (KVzip,
    Kim et al. 2025). After the full prefill the context is fed again, chunk by chunk, after a
    "repeat the previous context" prompt; an entry's score is the largest attention any
    reconstruction query gives it (max over its KV group's heads). Costs about one more prefill.

    chunk: context tokens per reconstruction pass (memory is bounded by one chunk); prompt: the
    reconstruction instruction (empty for a model without a tokenizer).
    What kvpress's KVzipPress does differently, each an option (`kvzip_kvpress` takes them all):
    chat_turn: on a model with a chat template, the prompt closes the user turn and opens the
    assistant's before the repeated chunk (and the template's head is not repeated); local: each
    chunk's softmax over its own span of the context (and the first tokens), not the whole
    context; continued: later chunks are asked to repeat "starting with" the previous chunk's
    last tokens; sinks: the first tokens always kept; budget: "layer" (each layer and KV head keeps
    kv_budget) or "global" (one threshold over every layer and head, the same total: kvpress's
    default allocation)."""

    kv_budget: float | int = 0.1
    window: int = 8
    chunk: int = 512
    prompt: str = DEFAULT_PROMPT
    per_head: bool = True
    chat_turn: bool = False
    local: bool = False
    continued: bool = False
    sinks: int = 0
    budget: str = "layer"
    name = "kvzip"
    compresses_kv = True

    def retention(self, plan, cache):
        return ReconstructionRetention(self, plan, cache)

    def validate(self):
        super().validate()
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"kvzip: chunk must be a positive int (context tokens per reconstruction pass), "
                             f"got {self.chunk!r}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"kvzip: prompt must be text, got {self.prompt!r}")
        for name in ("chat_turn", "local", "continued"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kvzip: {name} must be True or False, got {getattr(self, name)!r}")
        if self.budget not in ("layer", "global"):
            raise ValueError(f"kvzip: budget must be 'layer' (per layer and head) or 'global' (one threshold over "
                             f"every layer and head), got {self.budget!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"kvzip: sinks must be an int >= 0 (first tokens always kept), got {self.sinks!r}")


@dataclass
class KeyDiff(Method):
    """Query-agnostic: keep the keys least like the layer's average key (KeyDiff, Park et al. 2025):
    score = -cos(k_i, mean of the normalised keys), per KV head. No attention is computed, so it
    costs nothing beyond the prefill. `kernel`, `pooling`: the scores pooled over neighbouring
    tokens (kernel 1: the paper), so a distinctive token brings its sentence along (a fact's
    value and the words that name it)."""

    kv_budget: float | int = 0.1
    window: int = 8
    per_head: bool = True
    kernel: int = 1
    pooling: str | None = "max"
    name = "keydiff"
    compresses_kv = True

    def kv_scores(self, view):
        return self.heads(pool_scores(view.key_novelty() - 1, self.kernel, self.pooling))  # -cos, the paper's score


@dataclass
class ExpectedAttention(Method):
    """Query-agnostic: keep the keys future queries can be expected to attend to (Expected
    Attention, Devoto et al. 2025; `structkv.modules.scores.expected_attention`): a Gaussian model
    of the prompt's queries turned by the mean RoPE rotation of the next `future` positions.
    covariance: include the queries' spread; vnorm: weigh by ||v||; sinks: first tokens left out
    of the query statistics."""

    kv_budget: float | int = 0.1
    window: int = 8
    future: int = 512
    sinks: int = 4
    covariance: bool = True
    vnorm: bool = True
    per_head: bool = True
    name = "expected_attention"
    compresses_kv = True

    def kv_scores(self, view):
        key = ("expected", self.future, self.sinks, self.covariance, self.vnorm)
        scores = view.scores(key, lambda: expected_attention(
            view.q, view.k, view.v, view.positions, view.inv_freq, view.scale, self.future, self.sinks,
            self.covariance, self.vnorm))
        return self.heads(scores)

    def validate(self):
        super().validate()
        for name, low in (("future", 1), ("sinks", 0)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < low:
                raise ValueError(f"expected_attention: {name} must be an int >= {low}, got {x!r}")
        for name in ("covariance", "vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected_attention: {name} must be True or False, got {getattr(self, name)!r}")
