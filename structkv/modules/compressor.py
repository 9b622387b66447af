"""StructKVCompressor: StructKV's propagation, composed of the design-card modules.

- `CentralityTracker` accumulates C = sum_l decay^(L*-l) S^(l) over the scored layers;
- `PivotDetector` decides, per row, the layer where window attention turns from broad to focused
  (or a fixed pivot layer is given);
- `SkeletonPruner` keeps, at that layer, the row's top `keep` tokens by C plus the window.

It is a `Propagation`: the prefill loop (or a model of your own) calls `begin` once, then
`after_layer(view)` after every layer; when a row's pivot fires it returns the kept token
indices (B, K), and the caller gathers its hidden states with `pruner.gather`. Rows whose pivot
has not fired keep all their tokens. See the README, "Use the modules in your own model".
"""
from __future__ import annotations

import torch

from .centrality import CentralityTracker
from .pivot import PivotDetector
from .propagation import Propagation


class StructKVCompressor(Propagation):
    """Args:
        num_layers: model depth L; scored_layers: layers whose window attention is observed (all
            layers of a dense model, the full-attention layers of a hybrid).
        keep: tokens kept per row at its pivot (window included).
        window, kernel, pooling: the observation window and the saliency pooling.
        decay: lambda of the centrality. pivot: a fixed layer, or None to detect it per row.
        depth_range, weights, topk_ratio: the detector's candidate range, T weights and top-k mass k.
    """

    def __init__(self, num_layers: int, scored_layers: list[int], keep: list[int], *, window: int = 8,
                 kernel: int = 7, pooling: str | None = "max", decay: float = 0.9, pivot: int | None = None,
                 depth_range=(0.3, 0.6), weights=(0.2, 0.3, 0.5), topk_ratio: float = 0.2):
        super().__init__(len(keep), window)
        self.scored, self.keep, self.window, self.fixed_pivot = list(scored_layers), list(keep), window, pivot
        self.tracker = CentralityTracker(decay, window, kernel, pooling)
        self.detector = None
        if pivot is None:
            self.detector = PivotDetector(num_layers, self.scored, depth_range, weights, topk_ratio=topk_ratio)
            self.detector.reset(len(keep))

    def begin(self, num_tokens: int, device=None) -> "StructKVCompressor":
        """Start a prompt of `num_tokens` columns (padding included)."""
        self.tracker.reset(len(self.keep), num_tokens, device=device)
        return self

    @property
    def open(self) -> bool:
        """Some row's pivot has not fired yet: centrality is still accumulated."""
        return any(p is None for p in self.pivots)

    def window_needed(self, layer: int) -> int | None:
        return self.window if self.open and layer in self.scored else None

    def after_layer(self, view) -> torch.Tensor | None:
        layer = view.layer
        if self.window_needed(layer) is None:
            return None
        saliency, entropy = view.window_scores(self.window)
        self.tracker.observe(saliency, view.columns, layer=layer)
        if self.detector is not None:
            with view.timer.phase("scoring") as span:
                fired = self.detector.observe_scores(layer, saliency, entropy, view.positions)
            self.scoring_s += span.seconds
        else:
            fired = [layer == self.fixed_pivot] * len(self.keep)
        if not any(fired):
            return None
        n = view.k.shape[2]
        rows = [k if f else n for k, f in zip(self.keep, fired)]  # rows not firing keep everything
        self.pivots = [layer if f else p for f, p in zip(fired, self.pivots)]
        return self.pruner.select(self.tracker.current(view.columns), view.valid, rows)

    @property
    def host_syncs(self) -> int:
        return self.detector.host_syncs if self.detector is not None else 1

    def stats(self) -> dict:
        out = {"centrality_layers": self.tracker.layers}
        if self.detector is not None:
            curves = [t.t_curve for t in self.detector.traces]
            out["t_curve"] = curves if len(curves) > 1 else curves[0]
        return out
