"""`structkv::int8_head_logits`: one row's LM-head logits from int8 codes with one scale per block
of columns (32: GGUF's Q8_0 form, `structkv.models.int8_head`; the whole row: the per-row int8 head
of `weights="int8" | "int4"`, `structkv.models.quantized`), reading the codes once."""
from __future__ import annotations

import torch

from ..util.compiling import compiled

BLOCK = 32


def int8_block_row(h: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """h (1, E) float, codes (V, E) int8, scales (V, nb) -> (1, V): per block (E / nb columns), sum of
    code * h, times the block scale, summed over blocks. Written as a reduction for inductor: each
    code read once and converted in registers (one block per row: `int8_row_fused`)."""
    V, nb = scales.shape
    block = codes.shape[1] // nb
    inner = (h.view(1, 1, nb, block) * codes.view(1, V, nb, block)).sum(-1)  # (1, V, nb)
    return (inner * scales).sum(-1)  # (1, V)


@torch.library.custom_op("structkv::int8_head_logits", mutates_args=())
def int8_head_logits(h: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One row's logits from int8 blocks. Opaque to an enclosing compiled graph and compiled on its
    own: inside the decode graph inductor fused the final norm into this loop (recomputed per
    vocabulary row) and lost the gain; alone it is one loop reading the int8 codes once."""
    return compiled(int8_block_row, dynamic=False, fullgraph=True)(h, codes, scales)


@int8_head_logits.register_fake
def _(h, codes, scales):
    return h.new_empty(h.shape[0], codes.shape[0], dtype=torch.float32)
