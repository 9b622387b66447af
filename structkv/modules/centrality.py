"""CentralityTracker: StructKV's global in-degree centrality, accumulated over depth.

C_j = sum_l decay^(L*-l) S_j^(l), kept online as C <- decay^(l - l_prev) * C + S^(l) after each
scored layer l (l_prev: the previous scored layer). The exponent is the layer distance, so on a
hybrid model whose scored layers are 5 and 11 C = decay^6 S^(5) + S^(11), the paper's formula,
not decay * S^(5) + S^(11); on a dense model every distance is 1.
Scores arrive on the *current* tokens with their original column index, so C lives on the
original prompt columns and survives token subsetting (FastKV/StructKV propagation).

`observe` owns StructKV's conventions for S^(l): the window saliency (per KV head) is pooled over
the non-window tokens (the window is always kept, so never ranked: its columns get 0), summed
over KV heads and divided by the window size (the mean attention a token receives from one
window query). `update` takes S^(l) as given.
"""
from __future__ import annotations

import torch
from torch import nn

from .selection import pooled_saliency
from .structkv_config import StructKVConfig


class CentralityTracker(nn.Module):
    """Decayed sum of per-layer saliency on original token columns.

    Shapes: B batch, N original prompt columns, n current columns (n <= N).
    """

    def __init__(self, decay: float = 0.9, window: int = 8, kernel: int = 7, pooling: str | None = "max"):
        super().__init__()
        StructKVConfig(decay=decay, window=window, kernel=kernel, pooling=pooling)  # validated in one place
        self.decay, self.window, self.kernel, self.pooling = decay, window, kernel, pooling
        self.register_buffer("value", None, persistent=False)  # (B, N) float32 after reset
        self.layers: list[int] = []

    def forward(self, saliency: torch.Tensor, columns: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """`observe`: one layer's window saliency (B, Hkv, n) at `columns` (B, n) -> C (B, N)."""
        return self.observe(saliency, columns, layer)

    def reset(self, batch: int, num_tokens: int, device=None) -> None:
        self.value = torch.zeros(batch, num_tokens, dtype=torch.float32, device=device)
        self.layers = []

    def observe(self, saliency: torch.Tensor, columns: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Add one layer's window saliency (B, Hkv, n) of the current tokens at `columns` (B, n)."""
        pooled = pooled_saliency(saliency, self.window, self.kernel, self.pooling)
        return self.update(pooled.sum(1) / self.window, columns, layer)

    def update(self, scores: torch.Tensor, columns: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """C <- decay^(layer - previous layer) * C + S (one step of decay without layer numbers).
        scores (B, n) for the tokens at original `columns` (B, n)."""
        if self.value is None:
            raise RuntimeError("call reset(batch, num_tokens) before update()")
        if layer is not None and self.layers and layer <= self.layers[-1]:
            raise ValueError(f"layers must be observed in increasing order: {layer} after {self.layers[-1]}")
        distance = layer - self.layers[-1] if layer is not None and self.layers else 1
        self.value.mul_(self.decay ** distance)
        self.value.scatter_add_(1, columns, scores.float())
        if layer is not None:
            self.layers.append(layer)
        return self.value

    def per_layer(self) -> torch.Tensor:
        """C divided by the sum of its depth-decay weights: a weighted mean over the scored layers,
        on one layer's scale (B, N) (what a decode bound's "centrality" rule starts from)."""
        last = self.layers[-1] if self.layers else 0
        weight = sum(self.decay ** (last - layer) for layer in self.layers) if self.layers else 1.0
        return self.value / weight

    def current(self, columns: torch.Tensor) -> torch.Tensor:
        """Centrality of the current tokens: (B, n)."""
        return self.value.gather(1, columns)
