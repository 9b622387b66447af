"""KeyDiff (Park et al. 2025): query-agnostic, the keys least like the layer's average key."""
from __future__ import annotations

from dataclasses import dataclass

from ..modules import pool_scores
from .base import Method


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
