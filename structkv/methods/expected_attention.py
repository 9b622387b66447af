"""Expected Attention (Devoto et al. 2025): query-agnostic, the keys future queries can be expected
to attend to."""
from __future__ import annotations

from dataclasses import dataclass

from ..modules.scores import expected_attention
from .base import Method


@dataclass
class ExpectedAttention(Method):
    """Query-agnostic: keep the keys future queries can be expected to attend to (Expected
    Attention, Devoto et al. 2025; `structkv.modules.scores.expected_attention`): a Gaussian model
    of the prompt's queries turned by the mean RoPE rotation of the next `future` positions.
    covariance: include the queries' spread; vnorm: weigh by ||v||; sinks: first tokens left out
    of the query statistics."""

    kv_budget: float | int = 0.1
    window: int = 8
    future: int = 512
    sinks: int = 4
    covariance: bool = True
    vnorm: bool = True
    per_head: bool = True
    name = "expected_attention"
    compresses_kv = True

    def kv_scores(self, view):
        key = ("expected", self.future, self.sinks, self.covariance, self.vnorm)
        scores = view.scores(key, lambda: expected_attention(
            view.q, view.k, view.v, view.positions, view.inv_freq, view.scale, self.future, self.sinks,
            self.covariance, self.vnorm))
        return self.heads(scores)

    def validate(self):
        super().validate()
        for name, low in (("future", 1), ("sinks", 0)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < low:
                raise ValueError(f"expected_attention: {name} must be an int >= {low}, got {x!r}")
        for name in ("covariance", "vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected_attention: {name} must be True or False, got {getattr(self, name)!r}")
