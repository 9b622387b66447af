"""StructKVCompressor: StructKV's propagation, composed of the design-card modules.

- `CentralityTracker` accumulates C = sum_l decay^(L*-l) S^(l) over the scored layers;
- `PivotDetector` decides, per row, the layer where window attention turns from broad to focused
  (or a fixed pivot layer is given);
- `SkeletonPruner` keeps, at that layer, the row's top `keep` tokens by C plus the window.

It is a `Propagation` (an `nn.Module` whose submodules are the three above, the tracker's C a
buffer): the prefill loop (or a model of your own) calls `begin` once, then the module on each
layer's view (`after_layer`); when a row's pivot fires it returns the kept token indices (B, K),
and the caller gathers its hidden states with `pruner.gather`. Rows whose pivot has not fired
keep all their tokens. Its settings are one `StructKVConfig`, shared with the method that made
it. See the README, "Use the modules in your own model".
"""
from __future__ import annotations

import torch

from .centrality import CentralityTracker
from .pivot import PivotDetector
from .propagation import Propagation
from .selection import pooled_saliency
from .structkv_config import StructKVConfig


class StructKVCompressor(Propagation):
    """Args:
        num_layers: model depth L; scored_layers: layers whose window attention is observed (all
            layers of a dense model, the full-attention layers of a hybrid).
        keep: tokens kept per row at its pivot (window included); `keep_at(layer)`, when given,
            decides it at the pivot instead (equal prefill compute with another method).
        config: the `StructKVConfig` (window, pooling, decay, pivot or detection, skeleton, guide).
    """

    def __init__(self, num_layers: int, scored_layers: list[int], keep: list[int],
                 config: StructKVConfig = StructKVConfig(), keep_at=None):
        super().__init__(len(keep), config.window)
        self.config, self.scored, self.keep, self.keep_at = config, list(scored_layers), list(keep), keep_at
        self.window, self.fixed_pivot = config.window, config.pivot
        self.tracker = CentralityTracker(config.decay, config.window, config.kernel, config.pooling)
        self.detector = None
        if config.pivot is None:
            self.detector = PivotDetector.from_config(num_layers, self.scored, config)
            self.detector.reset(len(keep))
        self._guide = None

    def begin(self, num_tokens: int, device=None) -> "StructKVCompressor":
        """Start a prompt of `num_tokens` columns (padding included)."""
        self.tracker.reset(len(self.keep), num_tokens, device=device)
        self._guide = None
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
        saliency = self.signal(view)
        self.tracker.observe(saliency, view.columns, layer=layer)
        if self.detector is not None and not self.detector.wants(layer):
            return None  # before the curve's range: centrality only, no decision to read back
        if self.detector is not None:
            with view.timer.phase("scoring") as span:
                fired = self.detector.observe_scores(layer, saliency, view.positions, self.window, view.lengths)
            self.scoring_s += span.seconds
        else:
            fired = [layer == self.fixed_pivot] * len(self.keep)
        if not any(fired):
            return None
        n = view.k.shape[2]
        keep = self.keep_at(layer) if self.keep_at is not None else self.keep
        rows = [k if f else n for k, f in zip(keep, fired)]  # rows not firing keep everything
        self.pivots = [layer if f else p for f, p in zip(fired, self.pivots)]
        own = pooled_saliency(saliency, self.window, self.config.kernel, self.config.pooling)  # (B, Hkv, n)
        self._remember(own, view.columns, fired)
        scores = self._skeleton_scores(own.sum(1), view.columns, view.valid, rows, view.lengths)
        return self.pruner.select(scores, view.valid, rows, view.lengths)

    def signal(self, view) -> torch.Tensor:
        """S^(l) before pooling, (B, Hkv, n) (`LayerView.structure_signal`)."""
        return view.structure_signal(self.config.signal, self.window, self.config.window_share)

    def _skeleton_scores(self, own: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor, rows,
                         lengths: list[int]) -> torch.Tensor:
        """(B, n) scores whose top `rows` tokens form the skeleton."""
        centrality = self.tracker.current(columns)
        if self.config.skeleton == "centrality":
            return centrality
        if self.config.skeleton == "pivot":
            return own
        half = self.pruner.select(own, valid, [max(r // 2, min(self.window, r)) for r in rows], lengths)  # (B, K/2)
        first = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
        first = first.scatter_add_(1, half.clamp_min(0), (half >= 0).long()) > 0  # (B, n)
        top = centrality.max(dim=1, keepdim=True).values + 1  # above every centrality: kept first
        return torch.where(first, top, centrality)

    def _remember(self, own: torch.Tensor, columns: torch.Tensor, fired: list[bool]) -> None:
        """The guide of each row that fired, on prompt columns."""
        B, H, _ = own.shape
        N = self.tracker.value.shape[1]
        if self._guide is None:
            self._guide = torch.zeros(B, H if self.config.guide == "pivot" else 1, N, device=own.device)
        for b, f in enumerate(fired):
            if not f:
                continue
            if self.config.guide == "pivot":
                self._guide[b].scatter_(1, columns[b][None].expand(H, -1), own[b].float())
            else:
                self._guide[b, 0] = self.tracker.value[b]

    def guide(self) -> torch.Tensor | None:
        """(B, Hg, N) on prompt columns once every row's pivot fired (`GuidedRetention`), else None."""
        return None if self.open else self._guide

    @property
    def host_syncs(self) -> int:
        return self.detector.host_syncs if self.detector is not None else 0

    def stats(self) -> dict:
        out = {"centrality_layers": self.tracker.layers}
        if self.detector is not None:
            curves = [t.t_curve for t in self.detector.traces]
            out["t_curve"] = curves if len(curves) > 1 else curves[0]
        return out
