"""GemFilter (Shi et al. 2024): run layers 0..r, keep the tokens the last query's raw q.k ranks
highest at layer r, then re-encode only those, renumbered, through the whole model.

The method and its propagation live here together; the prefill loop only knows that a
propagation may restart (`Propagation.restart`, `restart_prompt`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..modules import Propagation, budget_tokens
from .base import Method, resolve_layer


class RestartPropagation(Propagation):
    """At `layer`, keep per row `keep[b]` tokens by the last query's raw logits (avg-pooled, shared
    by heads); the kept tokens are re-encoded by the whole model with positions 0..K-1 (GemFilter)."""

    restart = True

    def __init__(self, layer: int, keep: list[int], kernel: int):
        super().__init__(len(keep), 0, positions="compact")
        self.layer, self.keep, self.kernel = layer, keep, kernel
        self.host_syncs = 1  # the re-encode is a new prefill: it reads its row lengths once

    def after_layer(self, view) -> torch.Tensor | None:
        if view.layer != self.layer:
            return None
        score = view.last_query_logits(self.kernel)
        self.pivots = [self.layer] * len(self.keep)
        return self.pruner.select(score, view.valid, self.keep, view.lengths)

    def restart_prompt(self, tokens, view, kept):
        """The kept tokens in order, renumbered 0..K-1 (compact positions)."""
        columns, positions = self.pruner.gather(kept, view.columns, positions=view.positions)  # (B, K) each
        ids = torch.where(kept >= 0, tokens.gather(1, columns), torch.zeros_like(columns))
        return ids, positions, torch.where(kept >= 0, columns, torch.full_like(kept, -1))


@dataclass
class GemFilter(Method):
    """Run layers 0..r, pick tokens by the last query's raw q.k at layer r (avg-pooled, shared by
    heads), then re-run the whole model on the selected tokens with positions renumbered."""

    kv_budget: float | int = 0.1
    filter_layer: float | int = 13 / 32
    kernel: int = 5
    window: int = 0  # the official code forces nothing in
    fixed_options: ClassVar[tuple[str, ...]] = ("window",)  # a run's --window does not apply
    name = "gemfilter"  # scores with its own raw last-query q.k, not window_scores
    propagation_kind: ClassVar[type] = RestartPropagation

    def prefill_key(self):
        return ("gemfilter", id(self))  # its re-run depends on kv_budget: never shared

    def propagation(self, layout, lengths):
        layer = resolve_layer(self.filter_layer, layout, layout.full_attention_layers, "filter_layer")
        return RestartPropagation(layer, budget_tokens(self.kv_budget, lengths, "gemfilter kv_budget"), self.kernel)
