"""LayerView: what a method sees of one layer during the prefill, and the scores it may ask for.

Scores are computed on first request and memoised in a dict the loop shares between every method
reading the same tokens at this layer, so two methods asking for the same window pay once. The
view also records which scores were asked for since `used` was last cleared, so a shared prefill
can charge each method the scoring it needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops import window_scores
from ..util.timing import NO_TIMER, Timer
from .scores import (
    key_novelty,
    last_query_logits,
    percentile_of,
    percentile_union,
    ranked_columns,
    received_attention,
    share_of,
)


@dataclass
class LayerView:
    layer: int
    q: torch.Tensor  # (B, Hq, n, D), RoPE applied
    k: torch.Tensor  # (B, Hkv, n, D), RoPE applied
    v: torch.Tensor  # (B, Hkv, n, D)
    positions: torch.Tensor  # (B, n) original positions, -1 = padding
    columns: torch.Tensor  # (B, n) original prompt column of each current token
    scale: float
    memo: dict = field(default_factory=dict)  # key -> (scores, seconds), shared per (tokens, layer)
    timer: Timer = NO_TIMER
    used: set = field(default_factory=set)
    tp: object = None  # a TensorParallel: q/k/v hold this rank's heads, scores are gathered from all
    inv_freq: torch.Tensor | None = None  # (D/2,) the layer's RoPE frequencies (expected attention)
    lengths: list[int] | None = None  # valid tokens per row (host ints; read from positions if not given)

    def __post_init__(self):
        if self.lengths is None:  # a view made outside the prefill loop: one read-back
            self.lengths = (self.positions >= 0).sum(1).tolist()

    @property
    def num_kv_heads(self) -> int:
        """KV heads the scores cover (every rank's under tensor parallelism)."""
        return self.k.shape[1] * (self.tp.world if self.tp is not None else 1)

    @property
    def kv_heads(self) -> slice:
        """This rank's KV heads among the scores' heads (all of them without tensor parallelism)."""
        return self.tp.heads(self.k.shape[1]) if self.tp is not None else slice(None)

    @property
    def valid(self) -> torch.Tensor:
        return self.positions >= 0  # (B, n)

    def window_scores(self, window: int) -> torch.Tensor:
        """Saliency (B, Hkv, n) of the last `window` queries."""
        def compute():
            n = self.k.shape[2]
            return window_scores(self.q[:, :, n - window:], self.k, self.positions[:, n - window:].contiguous(),
                                 self.positions, scale=self.scale)
        return self.scores(("window", window), compute)

    def window_scores_per_query_head(self, window: int) -> torch.Tensor:
        """(B, Hq, n): each query head's attention from the last `window` queries (K repeated per
        query head, so the op's group sum is over one head)."""
        def compute():
            n, G = self.k.shape[2], self.q.shape[1] // self.k.shape[1]
            k = self.k.repeat_interleave(G, dim=1)  # (B, Hq, n, D)
            return window_scores(self.q[:, :, n - window:], k, self.positions[:, n - window:].contiguous(),
                                 self.positions, scale=self.scale)
        return self.scores(("window_q", window), compute)

    def key_novelty(self) -> torch.Tensor:
        """(B, Hkv, n): how unlike the layer's average key each key is (KeyDiff; query-free)."""
        return self.scores(("novelty",), lambda: key_novelty(self.k, self.valid))

    def structure_signal(self, kind: str, window: int, share: float = 0.5) -> torch.Tensor:
        """StructKV's per-layer score S^(l) (B, Hkv, n), before pooling (`StructKVConfig.signal`):
        "window" (the last `window` queries' attention), "novelty" (query-free), or "mixed": each
        as its share of the ranked columns (the window excluded), added. The window's attention is
        concentrated, so its confident picks come first and novelty orders the rest: what the end
        of a text looks back at (prose, code) beside what stands out in it (names, numbers).
        "union": each as its percentile rank among the ranked columns, the larger taken, so the
        top of either signal comes first: about `share` of the budget to the window's, the rest to
        novelty's (each rank's distance from the top stretched by its signal's share; 0.5 is the
        plain larger rank)."""
        if kind == "window":
            return self.window_scores(window)
        if kind == "novelty":
            return self.key_novelty()
        ranked = ranked_columns(self.valid, window)  # (B, n)
        blend = share_of if kind == "mixed" else percentile_of
        a, b = blend(self.window_scores(window), ranked), blend(self.key_novelty(), ranked)
        if kind == "mixed":
            return a + b
        return percentile_union(a, b, share)

    def received_attention(self) -> torch.Tensor:
        """(B, Hkv, n): attention received from every query (H2O)."""
        return self.scores(("received",), lambda: received_attention(self.q, self.k, self.positions, self.scale))

    def last_query_logits(self, kernel: int) -> torch.Tensor:
        """(B, n): GemFilter's last-query logits summed over every head, avg-pooled."""
        return self.scores(("last_query", kernel), lambda: last_query_logits(
            self.q, self.k, self.valid, kernel, reduce=self.tp.all_reduce if self.tp is not None else None))

    def scores(self, key, compute):
        """Scores computed once per (tokens, layer) under `key`: `compute()` runs on first request
        (timed as scoring) and its per-head result is gathered over every rank's heads under tensor
        parallelism; later requests, by this method or another on the same tokens, reuse it."""
        if key not in self.memo:
            with self.timer.phase("scoring") as span:
                value = self._gathered(compute())
            self.memo[key] = (value, span.seconds)
        self.used.add(key)
        return self.memo[key][0]

    def _gathered(self, value):
        """Per-head scores of this rank's heads -> of every rank's heads (identical on all ranks,
        so every rank keeps the same tokens); head-summed scores are reduced where computed."""
        if self.tp is None:
            return value
        if isinstance(value, tuple):
            return tuple(self._gathered(v) for v in value)
        return self.tp.gather_heads(value) if value.dim() == 3 else value

    def seconds(self, keys) -> float:
        """Scoring seconds of `keys` (what a method would have paid alone)."""
        return sum(self.memo[k][1] for k in keys)
