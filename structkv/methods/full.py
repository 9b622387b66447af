"""The full cache: no compression, the reference every method is measured against."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Method


@dataclass
class Full(Method):
    """Keeps every entry of every token. `centrality`: also accumulate StructKV's centrality over
    the prompt, what a decode-time KV bound's "centrality" rule starts from
    (`structkv.modules.decode_rules`): StructKV's propagation at R_KV = R_struct = 1.0 rides the
    pass, so the cache and the logits stay the full prefill's, exactly, for a few percent of its
    time (the scoring)."""

    centrality: bool = False
    name = "full"

    def plain(self) -> bool:
        return not self.centrality

    def propagation(self, layout, lengths):
        if not self.centrality:
            return None
        from .structkv import StructKV

        return StructKV(kv_budget=1.0, struct_budget=1.0).propagation(layout, lengths)

    def prefill_key(self) -> tuple:
        return ("all", "centrality") if self.centrality else ("all",)
