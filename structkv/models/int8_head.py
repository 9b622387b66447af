"""The LM head as int8 codes with one scale per block of 32 columns: exactly GGUF's Q8_0 form.

Decode on a CPU is bound by reading weights, and a small model's tied LM head is most of them
(Gemma 3 270M: 262144 x 640, 671 MB in float32 per token). Q8_0 weights are exactly d * q with
q an int8 and d one float16 per 32 values, so the same numbers fit in a quarter of the bytes.
`Int8BlockHead.from_weight` recovers (q, d) from the float matrix and refuses unless the
reconstruction is bit-exact; logits are then the same products summed in another order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.int8_head import BLOCK, int8_head_logits


class Int8BlockHead(nn.Module):
    """codes (V, E) int8 and scales (V, E / 32) float32; `logits(h)` for h (M, E) -> (M, V)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "Int8BlockHead":
        V, E = weight.shape
        if E % BLOCK:
            raise ValueError(f"an int8 head needs a hidden size divisible by {BLOCK}, got {E}")
        blocks = weight.detach().float().view(V, E // BLOCK, BLOCK)  # (V, nb, 32)
        # Q8_0 maps each block's largest magnitude to +-127, so d = amax / 127 exactly.
        scales = blocks.abs().amax(-1) / 127  # (V, nb)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
        codes = (blocks / safe).round()
        if codes.abs().max() > 127 or not torch.equal(codes * scales[..., None], blocks):
            raise ValueError("this LM head is not exactly int8 blocks of 32 (GGUF Q8_0 weights are); "
                             "keep the float head")
        return cls(codes.to(torch.int8).view(V, E), scales)

    def dequantize(self) -> torch.Tensor:
        V, E = self.codes.shape
        return (self.codes.view(V, E // BLOCK, BLOCK).float() * self.scales[..., None]).view(V, E)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (M, E) -> float32 logits (M, V). One row (decode) reads the int8 codes inside the
        reduction (compiled, that is one fused loop over 1/4 of the float bytes); more rows
        dequantize once and use a GEMM."""
        if h.shape[0] == 1:
            return int8_head_logits(h.float().contiguous(), self.codes, self.scales)
        return F.linear(h.float(), self.dequantize())
