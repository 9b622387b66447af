"""PivotDetector: find, per input, the layer where window attention turns from broad to focused.

Per scored layer l, three statistics of the window-averaged attention p over the *ranked*
columns only (the tokens a skeleton can keep or drop: not the first `sinks` tokens, which take
the attention sink's mass, and not the observation window, which is always kept); p sums to 1
over them (docs/algorithm.md, section 3):
- H_l: entropy of p normalised by log(ranked columns) (1 = uniform);
- rho_l: top-k mass of p, k = ceil(topk_ratio * ranked columns); a small k (1 %) stays below
  saturation, where k = R_struct * N measured ~0.9-1.0 at every layer and told nothing;
- V_l: n * var(p) (0 for uniform attention, scale-free in n).
Each statistic's layer-to-layer change is divided by that statistic's spread (max - min) over
the layers observed so far (from the one before the first candidate), so the weights
(w1, w2, w3) = (0.2, 0.3, 0.5) weigh comparable numbers:
    T_l = w1 * (-dH_l) / spread(H) + w2 * d(rho)_l / spread(rho) + w3 * dV_l / spread(V).
Rule (a confirmed peak, not the first dip): after each candidate layer (default depth
0.3L..0.6L) the curve is recomputed with the current spreads; the pivot fires at layer l once
the highest T among the candidates, if positive (attention got more focused), is at a layer
m <= l - confirm (the peak held for `confirm` more layers), or at the last candidate. The
paper's L* = argmax T + 1 is `confirm=1`.

At commit ac2fbc5 the statistics included the sink and window columns (90 % of T followed the
sink's variance) with a saturated top-k and raw relative changes, and the first dip fired (layer
11 on SmolLM2 before its transition at 12-13): `structkv_paper` now uses this reading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .structkv_config import StructKVConfig


@dataclass
class PivotTrace:
    """What the detector saw for one batch row."""

    stats: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # layer -> (H, rho, V)
    t_curve: dict[int, float] = field(default_factory=dict)  # layer -> T (last recomputation)
    pivot: int | None = None


def candidate_layers(num_layers: int, scored: list[int], depth_range=(0.3, 0.6)) -> list[int]:
    """Scored layers inside [ceil(lo*L), floor(hi*L)]; if none (hybrid models), the scored layer
    (not the last) nearest the range centre, deeper on ties."""
    lo, hi = math.ceil(depth_range[0] * num_layers), math.floor(depth_range[1] * num_layers)
    inside = [l for l in scored if lo <= l <= hi and l < num_layers - 1]
    if inside:
        return inside
    pool = [l for l in scored if l < num_layers - 1] or list(scored)
    centre = (lo + hi) / 2
    return [min(pool, key=lambda l: (abs(l - centre), -l))]


def ranked_mask(positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """(B, n) bool: real tokens that are neither among a row's first `sinks` nor in the window."""
    valid = positions >= 0
    rank = valid.long().cumsum(1) - 1  # index among real tokens
    n = positions.shape[1]
    col = torch.arange(n, device=positions.device)
    return valid & (rank >= sinks) & (col < n - window)[None]


def ranked_count(length: int, window: int, sinks: int) -> int:
    """Ranked columns of a left-padded row of `length` valid tokens (`ranked_mask`'s row sum)."""
    return max(0, length - window - sinks)


def transition_curve(stats: dict[int, tuple], weights, eps: float = 1e-9) -> dict[int, float]:
    """T at every observed layer after the first, each statistic's change over its spread."""
    layers = sorted(stats)
    if len(layers) < 2:
        return {}
    cols = list(zip(*(stats[l] for l in layers)))  # (H...), (rho...), (V...)
    spreads = [max(c) - min(c) + eps for c in cols]
    signs = (-1.0, 1.0, 1.0)  # focus = lower entropy, more top-k mass, more variance
    out = {}
    for a, b in zip(layers, layers[1:]):
        out[b] = sum(w * s * (stats[b][i] - stats[a][i]) / spreads[i]
                     for i, (w, s) in enumerate(zip(weights, signs)))
    return out


class PivotDetector(nn.Module):
    """Online pivot detection per batch row. `forward(layer, saliency, positions, window,
    lengths)` observes one layer and returns, per row, whether its pivot fires there. Its state
    is the per-row traces of (H, rho, V) on the host: the decision is a host decision (each
    observed layer is one read-back, counted in `host_syncs`), so no tensor state is kept.

    Args:
        num_layers: model depth L. scored_layers: layers whose window attention is observed
            (all layers for dense models, the full-attention layers for hybrids).
        depth_range: candidate range as fractions of L. weights: (w1, w2, w3) for (-H, rho, V).
        topk_ratio: k of the top-k mass as a fraction of the ranked columns.
        confirm: layers the highest T must hold before the pivot fires (1 = the paper's argmax + 1).
        sinks: first tokens left out of the statistics (they hold the attention sink).
        observe_all: never fire; record the statistics over every scored layer (calibration).
    """

    def __init__(self, num_layers: int, scored_layers: list[int], depth_range=(0.3, 0.6),
                 weights=(0.2, 0.3, 0.5), topk_ratio: float = 0.01, confirm: int = 2, sinks: int = 4,
                 observe_all: bool = False):
        super().__init__()
        StructKVConfig(depth_range=depth_range, weights=weights, topk_ratio=topk_ratio, confirm=confirm,
                       sinks=sinks)  # validated where every StructKV setting is
        self.num_layers, self.scored = num_layers, sorted(scored_layers)
        self.candidates = candidate_layers(num_layers, self.scored, depth_range)
        before = [l for l in self.scored if l < self.candidates[0]]
        self.first = before[-1] if before else self.candidates[0]  # the curve starts one scored layer earlier
        self.weights, self.topk_ratio, self.confirm, self.sinks = tuple(weights), topk_ratio, confirm, sinks
        self.observe_all = observe_all
        self.traces: list[PivotTrace] = []
        self.host_syncs = 0

    def forward(self, layer: int, saliency: torch.Tensor, positions: torch.Tensor, window: int,
                lengths: list[int] | None = None) -> list[bool]:
        """`observe_scores`: whether each row's pivot fires at `layer`."""
        return self.observe_scores(layer, saliency, positions, window, lengths)

    @classmethod
    def from_config(cls, num_layers: int, scored_layers: list[int], config) -> "PivotDetector":
        """The detector a `StructKVConfig` describes."""
        return cls(num_layers, scored_layers, config.depth_range, config.weights, topk_ratio=config.topk_ratio,
                   confirm=config.confirm, sinks=config.sinks)

    def reset(self, batch: int) -> None:
        self.traces = [PivotTrace() for _ in range(batch)]
        self.host_syncs = 0

    def wants(self, layer: int) -> bool:
        """Whether `layer`'s statistics are needed (the curve's range, or every layer when calibrating)."""
        return self.observe_all or self.first <= layer <= self.candidates[-1]

    @staticmethod
    def statistics(saliency: torch.Tensor, ranked: torch.Tensor, topk_ratio: float,
                   most_ranked: int | None = None) -> torch.Tensor:
        """(B, 3) = (H, rho, V) of saliency (B, Hkv, n) over the `ranked` (B, n) columns;
        `most_ranked`: the largest ranked count of a row, when known (else read back)."""
        s = saliency.sum(1).double() * ranked  # (B, n)
        p = s / s.sum(-1, keepdim=True).clamp_min(1e-30)
        n = ranked.sum(-1).clamp_min(2).double()  # (B,)
        h = -(p * p.clamp_min(1e-30).log()).sum(-1) / n.log()
        most = int(n.max()) if most_ranked is None else max(most_ranked, 2)
        k = max(1, math.ceil(topk_ratio * most))
        rho = p.topk(min(k, p.shape[-1]), dim=-1).values.sum(-1)
        var = (((p - 1 / n[:, None]) ** 2) * ranked).sum(-1)  # n * mean squared deviation
        return torch.stack([h, rho, var], dim=-1).float()

    def observe_scores(self, layer: int, saliency: torch.Tensor, positions: torch.Tensor, window: int,
                       lengths: list[int] | None = None) -> list[bool]:
        """`observe` from the window saliency (B, Hkv, n) of the current tokens at positions (B, n);
        `lengths`: the rows' valid tokens when known (then `observe` is the only read-back)."""
        ranked = ranked_mask(positions, window, self.sinks)
        most = None if lengths is None else max(ranked_count(l, window, self.sinks) for l in lengths)
        return self.observe(layer, self.statistics(saliency, ranked, self.topk_ratio, most))

    def observe(self, layer: int, stats: torch.Tensor) -> list[bool]:
        """Record layer `layer`'s stats (B, 3); returns, per row, whether its pivot fires here."""
        values = stats.tolist()
        self.host_syncs += 1
        fired = []
        for trace, cur in zip(self.traces, values):
            trace.stats[layer] = tuple(cur)
            trace.t_curve = transition_curve({l: s for l, s in trace.stats.items()  # the same range calibrating
                                              if self.first <= l <= self.candidates[-1]}, self.weights)
            fire = False
            if trace.pivot is None and not self.observe_all and layer in self.candidates:
                seen = {l: t for l, t in trace.t_curve.items() if l in self.candidates}
                peak = max(seen, key=seen.get) if seen and max(seen.values()) > 0 else None  # a focusing step
                later = [l for l in self.candidates if peak is not None and peak < l <= layer]
                fire = len(later) >= self.confirm or layer == self.candidates[-1]
                if fire:
                    trace.pivot = layer
            fired.append(fire)
        return fired


def calibrate_pivot(traces: list[PivotTrace], candidates: list[int], confirm: int = 1) -> int:
    """Offline mode: average T over prompts, take the argmax candidate, fire `confirm` candidate
    layers later (the paper's L* = argmax + 1 for confirm=1)."""
    means = {}
    for l in candidates:
        vals = [t.t_curve[l] for t in traces if l in t.t_curve]
        if vals:
            means[l] = sum(vals) / len(vals)
    if not means:
        return candidates[-1]
    best = max(means, key=means.get)
    later = [l for l in candidates if l > best]
    return later[min(confirm, len(later)) - 1] if later else best
