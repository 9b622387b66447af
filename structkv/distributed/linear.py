"""The row-parallel projection: each rank multiplies its slice of the input features by its columns
of the weight, and the partial outputs are summed over ranks (o_proj, down_proj)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Linear):
    """nn.Linear over this rank's input slice, followed by an all-reduce (same parameter names, so
    checkpoints load as they are sliced). A bias would be added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, tp, bias: bool = False):
        super().__init__(in_local, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
