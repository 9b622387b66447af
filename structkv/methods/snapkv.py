"""SnapKV and PyramidKV: each layer keeps the entries its observation window attends to most
(`WindowScored` holds the scoring every window method shares: FastKV and StructKV build on it)."""
from __future__ import annotations

from dataclasses import dataclass

from ..modules import pooled_saliency
from .base import Method


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
