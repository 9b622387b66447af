"""SkeletonPruner: keep the top tokens by a score plus the observation window, and gather them.

Used at StructKV's pivot (score = centrality), at FastKV's TSP layer (score = that layer's
saliency) and for GemFilter's restart (score = raw last-query logits, positions renumbered).
"""
from __future__ import annotations

import torch
from torch import nn

from .selection import gather_tokens, kept_counts, select_tokens


class SkeletonPruner(nn.Module):
    """Select and gather a token skeleton. `forward` selects (`select`); `gather` takes the kept
    tokens. No tensor state: `counts` holds the kept tokens per row of the last selection (host
    ints), so the caller knows the new lengths without reading them back from the device.

    Args:
        window: observation-window size (always kept).
        positions: "original" keeps each token's position id (FastKV/StructKV); "compact"
            renumbers the kept tokens 0..K-1 (GemFilter's re-encode).
    Shapes: B batch, n current tokens, E hidden size, K kept tokens (max over rows).
    """

    def __init__(self, window: int = 8, positions: str = "original"):
        super().__init__()
        if positions not in ("original", "compact"):
            raise ValueError(f"positions must be 'original' or 'compact', got {positions!r}")
        self.window, self.positions = window, positions
        self.counts: list[int] | None = None

    def forward(self, scores: torch.Tensor, valid: torch.Tensor, keep: list[int],
                lengths: list[int] | None = None) -> torch.Tensor:
        """`select`: scores (B, n) -> sorted kept columns (B, K), -1 left padding."""
        return self.select(scores, valid, keep, lengths)

    def select(self, scores: torch.Tensor, valid: torch.Tensor, keep: list[int],
               lengths: list[int] | None = None) -> torch.Tensor:
        """scores (B, n), valid (B, n) -> sorted kept columns (B, K), -1 left padding. `lengths`:
        the rows' valid tokens if known (no host sync)."""
        lengths = valid.sum(1).tolist() if lengths is None else lengths
        self.counts = kept_counts(keep, lengths)
        return select_tokens(scores[:, None], valid, keep, self.window, lengths)[:, 0]

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
