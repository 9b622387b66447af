"""PivotDetector: find, per input, the layer where window attention turns from broad to focused.

Per scored layer l, three statistics of the window attention (docs/algorithm.md, section 3):
- H_l: entropy of each window query's attention, normalised by log(visible keys), averaged over
  heads and queries (from `window_scores`' entropy output, no probabilities materialised);
- rho_l: top-k mass of the normalised saliency p = S / sum(S), k = ceil(topk_ratio * length);
- V_l: variance over tokens of p (scale-free).
Their relative layer-to-layer changes dX_l = (X_l - X_prev) / (|X_prev| + eps) are combined into
    T_l = w1 * d(-H)_l + w2 * d(rho)_l + w3 * d(V)_l,   (w1, w2, w3) = (0.2, 0.3, 0.5).
Online rule: inside the candidate layers (default depth 0.3L..0.6L), the pivot fires at the
first layer whose T drops below a T that was the maximum so far (L* = argmax T + 1), or at the
last candidate. rho and V use the window-averaged saliency instead of per-row probabilities:
that avoids materialising (Hq, w, N) attention (documented deviation from G3's per-row average).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class PivotTrace:
    """What the detector saw for one batch row."""

    stats: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # layer -> (H, rho, V)
    t_curve: dict[int, float] = field(default_factory=dict)  # layer -> T
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


class PivotDetector:
    """Online pivot detection per batch row (host-side decisions; each `observe` is one sync).
    A plain object: its state is the per-row traces on the host, no tensors.

    Args:
        num_layers: model depth L. scored_layers: layers whose window attention is observed
            (all layers for dense models, the full-attention layers for hybrids).
        depth_range: candidate range as fractions of L. weights: (w1, w2, w3) for (-H, rho, V).
        topk_ratio: k of the top-k mass as a fraction of the row length (R_struct by default).
    """

    def __init__(self, num_layers: int, scored_layers: list[int], depth_range=(0.3, 0.6),
                 weights=(0.2, 0.3, 0.5), topk_ratio: float = 0.2, eps: float = 1e-6):
        if not 0.0 <= depth_range[0] <= depth_range[1] <= 1.0:
            raise ValueError(f"depth_range must satisfy 0 <= lo <= hi <= 1, got {depth_range}")
        self.num_layers, self.scored = num_layers, sorted(scored_layers)
        self.candidates = candidate_layers(num_layers, self.scored, depth_range)
        self.weights, self.topk_ratio, self.eps = tuple(weights), topk_ratio, eps
        self.traces: list[PivotTrace] = []
        self.host_syncs = 0

    def reset(self, batch: int) -> None:
        self.traces = [PivotTrace() for _ in range(batch)]
        self.host_syncs = 0

    @staticmethod
    def statistics(saliency: torch.Tensor, entropy: torch.Tensor, n_visible: torch.Tensor, valid: torch.Tensor,
                   topk_ratio: float) -> torch.Tensor:
        """(B, 3) = (H, rho, V) from saliency (B, Hkv, n), entropy (B, Hq, w), n_visible (B, w), valid (B, n)."""
        logn = torch.log(n_visible.float().clamp_min(2))[:, None, :]  # (B, 1, w)
        h_norm = (entropy / logn).mean(dim=(1, 2))  # (B,)
        s = saliency.sum(1) * valid  # (B, n)
        p = s / s.sum(-1, keepdim=True).clamp_min(1e-30)
        lengths = valid.sum(-1)
        k = max(1, math.ceil(topk_ratio * int(lengths.max())))
        rho = p.topk(min(k, p.shape[-1]), dim=-1).values.sum(-1)
        mean = 1.0 / lengths.clamp_min(1)
        var = (((p - mean[:, None]) ** 2) * valid).sum(-1) / lengths.clamp_min(1)
        return torch.stack([h_norm, rho, var], dim=-1)

    def observe_scores(self, layer: int, saliency: torch.Tensor, entropy: torch.Tensor,
                       positions: torch.Tensor) -> list[bool]:
        """`observe` from the window scores of the current tokens: saliency (B, Hkv, n), entropy
        (B, Hq, w) of the last w queries, positions (B, n) (-1 = padding). Each window query's
        entropy is normalised by the log of the keys it sees (visible: not padding, not later)."""
        w, valid = entropy.shape[-1], positions >= 0
        n_visible = (valid[:, None, :] & (positions[:, None, :] <= positions[:, -w:, None])).sum(-1)  # (B, w)
        return self.observe(layer, self.statistics(saliency, entropy, n_visible, valid, self.topk_ratio))

    def transition(self, prev: tuple, cur: tuple) -> float:
        rel = lambda a, b: (b - a) / (abs(a) + self.eps)  # noqa: E731
        w1, w2, w3 = self.weights
        return w1 * rel(-prev[0], -cur[0]) + w2 * rel(prev[1], cur[1]) + w3 * rel(prev[2], cur[2])

    def observe(self, layer: int, stats: torch.Tensor) -> list[bool]:
        """Record layer `layer`'s stats (B, 3); returns, per row, whether its pivot fires here."""
        values = stats.tolist()
        self.host_syncs += 1
        fired = []
        for trace, cur in zip(self.traces, values):
            prev_layers = [l for l in trace.stats if l < layer]
            if prev_layers:
                trace.t_curve[layer] = self.transition(trace.stats[max(prev_layers)], tuple(cur))
            trace.stats[layer] = tuple(cur)
            fire = False
            if trace.pivot is None and layer in self.candidates:
                ts = [trace.t_curve[l] for l in self.candidates if l in trace.t_curve and l < layer]
                t_now = trace.t_curve.get(layer)
                if ts and t_now is not None and t_now < ts[-1] and ts[-1] == max(ts):
                    fire = True  # the previous candidate was the peak: L* = argmax + 1
                if layer == self.candidates[-1]:
                    fire = True  # forced at the end of the range
                if fire:
                    trace.pivot = layer
            fired.append(fire)
        return fired


def calibrate_pivot(traces: list[PivotTrace], candidates: list[int]) -> int:
    """Offline mode: average T over prompts, take the argmax candidate, fire at the next one."""
    means = {}
    for l in candidates:
        vals = [t.t_curve[l] for t in traces if l in t.t_curve]
        if vals:
            means[l] = sum(vals) / len(vals)
    if not means:
        return candidates[-1]
    best = max(means, key=means.get)
    later = [l for l in candidates if l > best]
    return later[0] if later else best
