"""StructKVConfig: StructKV's settings in one validated value, declared once.

`Structure` declares the structural settings; the method (`structkv.methods.StructKV`) inherits
them as its options and `StructKVConfig` inherits them as its fields. The method, its compressor
(`StructKVCompressor`) and the modules the compressor is made of (`CentralityTracker`,
`PivotDetector`, `SkeletonPruner`) read their settings from one `StructKVConfig`, validated once
when it is made (the tracker and the detector, built by hand, validate through it too), so a bad
value is refused with one message wherever it comes from.
"""
from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, dataclass, fields


@dataclass
class Structure:
    """StructKV's structural settings, declared once: the method (`structkv.methods.StructKV`) takes
    them as its options by inheriting this class, and `StructKVConfig` adds what the compressor needs
    beside them (the window, the pooling, the resolved pivot) and validates the lot. Defaults are the
    configuration chosen on the development split (docs/methods.md); the paper's is `structkv_paper`.

    Args:
        decay: lambda of the centrality C <- lambda^(layer distance) * C + S.
        depth_range, weights, topk_ratio, confirm, sinks: the detector's candidate depths, weights
            of (-dH, d rho, dV), top-k mass, confirmation layers and left-out first tokens.
        skeleton: tokens kept at the pivot, top by "centrality" (the paper), "pivot" (the pivot
            layer's saliency) or "union" (half each).
        guide: what the compressor offers the KV retention once every row fired: "pivot" (the
            pivot layer's pooled saliency per KV head) or "centrality" (C).
        signal: the per-layer score S^(l) the structure is built from: "window" (the observation
            window's attention: the paper; needs the question in the window) or "novelty" (how
            unlike the layer's average key each key is, `key_novelty`: query-free, for contexts
            compressed before any question is known), or both: "mixed" (each as its share of the
            ranked columns, added) or "union" (the larger percentile rank; `LayerView.structure_signal`).
        window_share: under "union", the window's share of the kept columns (novelty has the rest);
            0.5 is the plain larger percentile rank.
    """

    decay: float = 0.9
    depth_range: tuple[float, float] = (0.3, 0.6)
    weights: tuple[float, float, float] = (0.2, 0.3, 0.5)
    topk_ratio: float = 0.01
    confirm: int = 2
    sinks: int = 4
    skeleton: str = "pivot"
    guide: str = "pivot"
    signal: str = "window"
    window_share: float = 0.5


STRUCTURE = tuple(f.name for f in fields(Structure))
SIGNALS = ("window", "novelty", "mixed", "union")


@dataclass(unsafe_hash=True)
class StructKVConfig(Structure):
    """The compressor's settings: the `Structure` fields plus
        window, kernel, pooling: the observation window (always kept) and the saliency pooling;
        pivot: a fixed pivot layer, or None to detect it per row (`PivotDetector`).
    Validated when made and read-only afterwards (a value: hashable, compared by its fields);
    lists (JSON, the command line) become tuples.
    """

    window: int = 8
    kernel: int = 7
    pooling: str | None = "max"
    pivot: int | None = None

    def __setattr__(self, name, value):
        if getattr(self, "_sealed", False):
            raise FrozenInstanceError(f"StructKVConfig is read-only; use dataclasses.replace(config, {name}=...)")
        object.__setattr__(self, name, value)

    def __post_init__(self):
        for name in ("depth_range", "weights"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        self._validate()
        self._sealed = True

    def _validate(self):
        for name in ("window", "kernel", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.pooling not in ("max", "avg", None):
            raise ValueError(f"pooling must be 'max', 'avg' or None, got {self.pooling!r}")
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        if self.pivot is not None and (isinstance(self.pivot, bool) or not isinstance(self.pivot, int)
                                       or self.pivot < 0):
            raise ValueError(f"pivot must be a layer index >= 0 or None (detected), got {self.pivot!r}")
        if self.skeleton not in ("centrality", "pivot", "union"):
            raise ValueError(f"skeleton must be 'centrality', 'pivot' or 'union', got {self.skeleton!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be 'window', 'novelty', 'mixed' or 'union', got {self.signal!r}")
        share = self.window_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ValueError(f"window_share must be a fraction in (0, 1) (the window's share under signal 'union'), "
                             f"got {share!r}")
        if self.signal != "window" and self.pivot is None:
            raise ValueError(f"signal {self.signal!r} needs a fixed pivot: the detector reads attention statistics")
        if self.guide not in ("pivot", "centrality"):
            raise ValueError(f"guide must be 'pivot' or 'centrality', got {self.guide!r}")
        if isinstance(self.confirm, bool) or not isinstance(self.confirm, int) or self.confirm < 1:
            raise ValueError(f"confirm must be an int >= 1 (layers a peak must hold), got {self.confirm!r}")
        if (isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float))
                or not 0 < self.topk_ratio <= 1):
            raise ValueError(f"topk_ratio must be a fraction in (0, 1], got {self.topk_ratio!r}")
        w = self.weights
        if (not isinstance(w, (tuple, list)) or len(w) != 3
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                           for x in w) or sum(w) <= 0):
            raise ValueError(f"weights must be three finite numbers >= 0, not all 0 (entropy, top-k mass, "
                             f"variance), got {w!r}")
        r = self.depth_range
        if (not isinstance(r, (tuple, list)) or len(r) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)
                or not 0 <= r[0] <= r[1] <= 1):
            raise ValueError(f"depth_range must be two fractions 0 <= lo <= hi <= 1, got {r!r}")
