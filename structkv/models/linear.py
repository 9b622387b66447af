"""`Linear`: nn.Linear with a faster CPU path for the few rows of a decode step.

torch's CPU kernels run x (M, in) @ W^T at M = 1-3 float32 rows as slow matrix-vector products
(measured on the 2-core reference machine: Gemma 3 270M's 126 projections take 28 ms per decode
step at one row, 44 ms at two), while W @ x^T as a GEMM takes 14.5 ms (one row padded to two)
and 11 ms (research/benchmarks_log.md, "Continuous batching"). A decode step (one token per row: x (B, 1,
in)) of up to `SKINNY_ROWS` rows therefore goes as W @ x^T; everything else is nn.Linear's.
"""
from __future__ import annotations

import torch
from torch import nn

SKINNY_ROWS = 4  # projections: W @ x^T is faster up to here; at 8 rows both take the same time
HEAD_ROWS = 11  # the LM head (a large vocabulary): faster up to here (12 rows: about the same)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.dim() == 3 and x.shape[1] == 1 and x.shape[0] <= SKINNY_ROWS):
            return skinny(x[:, 0], self.weight, self.bias)[:, None]
        return super().forward(x)


def skinny(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows (B, in) @ W^T (+ bias) computed as W @ rows^T: (B, out); one row is padded to two (a
    GEMM, not a matrix-vector product)."""
    B = rows.shape[0]
    if B == 1:
        rows = torch.cat([rows, rows])  # (2, in)
    out = torch.mm(weight, rows.t()).t()[:B]  # (out, in) @ (in, B) -> (B, out)
    return out if bias is None else out + bias
