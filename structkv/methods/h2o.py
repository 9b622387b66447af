"""H2O (Zhang et al. 2023): heavy hitters, the entries that receive the most attention from every
prompt query."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Method


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
