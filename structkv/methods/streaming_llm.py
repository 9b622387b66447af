"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method


@dataclass
class StreamingLLM(Method):
    """Keep `sinks` first tokens plus the most recent ones (FastKV port: at prefill end, original
    positions, no re-rotation)."""

    kv_budget: float | int = 0.1
    sinks: int = 4
    window: int = 8
    name = "streaming_llm"
    compresses_kv = True

    def validate(self) -> None:
        super().validate()
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"streaming_llm: sinks must be an int >= 0 (first tokens always kept), got {self.sinks!r}")

    def kv_scores(self, view):
        """The first `sinks` real tokens first, then the most recent (higher position = keep)."""
        pos = view.positions
        rank = view.valid.long().cumsum(1) - 1  # (B, n) index among real tokens
        return torch.where(rank < self.sinks, torch.full_like(pos, 1 << 40), pos).float()[:, None]  # (B, 1, n)
