"""SkeletonPruner: keep the top tokens by a score plus the observation window, and gather them.

Used at StructKV's pivot (score = centrality), at FastKV's TSP layer (score = that layer's
saliency) and for GemFilter's restart (score = raw last-query logits, positions renumbered).
"""
from __future__ import annotations

import torch

from .selection import gather_tokens, select_tokens


class SkeletonPruner:
    """Select and gather a token skeleton (a plain object: no tensor state).

    Args:
        window: observation-window size (always kept).
        positions: "original" keeps each token's position id (FastKV/StructKV); "compact"
            renumbers the kept tokens 0..K-1 (GemFilter's re-encode).
    Shapes: B batch, n current tokens, E hidden size, K kept tokens (max over rows).
    """

    def __init__(self, window: int = 8, positions: str = "original"):
        if positions not in ("original", "compact"):
            raise ValueError(f"positions must be 'original' or 'compact', got {positions!r}")
        self.window, self.positions = window, positions

    def select(self, scores: torch.Tensor, valid: torch.Tensor, keep: list[int]) -> torch.Tensor:
        """scores (B, n), valid (B, n) -> sorted kept columns (B, K), -1 left padding."""
        return select_tokens(scores[:, None], valid, keep, self.window)[:, 0]

    def gather(self, indices: torch.Tensor, *tensors: torch.Tensor, positions: torch.Tensor):
        """Gather each (B, n, ...) tensor at `indices` (B, K); returns them plus the new positions.

        Padding slots get position -1 (invisible). "compact" renumbers kept tokens from 0.
        """
        out = [gather_tokens(t, indices) for t in tensors]
        new_pos = gather_tokens(positions, indices, fill=-1)
        if self.positions == "compact":
            valid = indices >= 0
            new_pos = torch.where(valid, valid.long().cumsum(1) - 1, torch.full_like(new_pos, -1))
        return (*out, new_pos)
