"""CentralityTracker: StructKV's global in-degree centrality, accumulated over depth.

C_j = sum_l decay^(L*-l) S_j^(l), kept online as C <- decay * C + S^(l) after each scored layer.
Scores arrive on the *current* tokens with their original column index, so C lives on the
original prompt columns and survives token subsetting (FastKV/StructKV propagation).
"""
from __future__ import annotations

import torch
from torch import nn


class CentralityTracker(nn.Module):
    """Decayed sum of per-layer saliency on original token columns.

    Shapes: B batch, N original prompt columns, n current columns (n <= N).
    """

    def __init__(self, decay: float = 0.9):
        super().__init__()
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.value: torch.Tensor | None = None  # (B, N) float32
        self.layers: list[int] = []

    def reset(self, batch: int, num_tokens: int, device=None) -> None:
        self.value = torch.zeros(batch, num_tokens, dtype=torch.float32, device=device)
        self.layers = []

    def update(self, scores: torch.Tensor, columns: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """C <- decay * C + S. scores (B, n) for the tokens at original `columns` (B, n)."""
        if self.value is None:
            raise RuntimeError("call reset(batch, num_tokens) before update()")
        self.value.mul_(self.decay)
        self.value.scatter_add_(1, columns, scores.float())
        if layer is not None:
            self.layers.append(layer)
        return self.value

    def current(self, columns: torch.Tensor) -> torch.Tensor:
        """Centrality of the current tokens: (B, n)."""
        return self.value.gather(1, columns)
