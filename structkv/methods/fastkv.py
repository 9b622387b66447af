"""FastKV (Jo et al. 2025): token-selective propagation at one fixed layer (TSP) plus SnapKV-style
KV selection at every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..modules import FixedLayerPropagation, budget_tokens
from .base import resolve_layer
from .snapkv import WindowScored


@dataclass
class FastKV(WindowScored):
    """Token-selective propagation at a fixed layer plus per-layer KV selection."""

    tsp_layer: float | int = 15 / 32
    struct_budget: float | int = 0.2
    name = "fastkv"
    has_struct_budget: ClassVar[bool] = True

    def prefill_key(self):
        return ("fastkv", self.tsp_layer, self.struct_budget, self.window, self.kernel, self.pooling)

    def propagation(self, layout, lengths):
        layer = resolve_layer(self.tsp_layer, layout, layout.full_attention_layers, "tsp_layer")
        keep = self.fit_window(budget_tokens(self.struct_budget, lengths, "fastkv struct_budget"), lengths)
        return FixedLayerPropagation(layer, keep, self.window, self.kernel, self.pooling)
