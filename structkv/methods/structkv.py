"""StructKV (arXiv 2604.06746): global centrality over depth, a dynamic pivot, skeleton
propagation and decoupled budgets; its modules are `structkv.modules` (`StructKVCompressor`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..modules import StructKVCompressor, budget_tokens, pooled_saliency
from ..modules.structkv_config import SIGNALS, STRUCTURE, StructKVConfig, Structure
from .base import resolve_layer
from .fastkv import FastKV
from .snapkv import WindowScored, pyramid_keep


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
