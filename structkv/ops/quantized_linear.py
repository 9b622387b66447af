"""`structkv::int8_linear`, `structkv::int4_linear`: x (M, K) bf16 times a packed weight -> (M, N)
bf16, on PyTorch's packed CPU kernels (`structkv.models.quantized` holds the weights).

Few rows (decode) run the packed kernel, which reads the 1- or 0.5-byte codes once; many rows (a
prompt) unpack the weight to bf16 once and run a GEMM, measured faster at a 4K prompt (Gemma 3
270M, 2 threads: int8 3.6 s vs 5.4 s, int4 4.2 vs 5.6). The choice depends on M: inside a graph
compiled for any prompt length a branch on M would be a guard on the length, so there the product
is an opaque op; a single row (a decode step) calls the same function directly and the kernel sits
in the graph (an opaque op is a Python call per product: ~9 us, 7 per layer, every decoded token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DENSE_ROWS = 128  # products of at least this many rows unpack the weight and run a GEMM


def int8_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16, codes (N, K) int8, scales (N,) bf16 -> x @ (codes * scales)^T (M, N) bf16.
    Called directly for one row (a decode step: the kernel sits in the compiled graph without a
    Python call); through the op `int8_linear` otherwise."""
    if x.shape[0] >= DENSE_ROWS:
        return F.linear(x, codes.to(torch.bfloat16) * scales[:, None])
    return torch.ops.aten._weight_int8pack_mm(x, codes, scales)


def int4_product(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x (M, K) bf16, the CPU int4 packing of an (N, K) weight and its (K / group, N, 2) bf16
    (scale, zero) table -> (M, N) bf16, where w = (code - 8) * scale + zero."""
    if x.shape[0] >= DENSE_ROWS:
        return F.linear(x, int4_weight(packed, scale_zero, group, x.shape[1]))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero)


def int8_row_fused(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (1, K) float32, codes (N, K) int8, scales (N,) -> x @ (codes * scales)^T (1, N) float32,
    written as a reduction for inductor to compile: one loop that reads each code once and
    converts it in registers (no bf16 rounding of x). Inside a compiled decode step this beats the
    packed kernel, measured on the 2-core reference machine: Gemma 3 270M's 126 int8 projections
    5.4 -> 4.3 ms per step, its 262K-row int8 head 6.9 -> 4.9 ms; decode 55 -> 66-73 tokens/s at
    1K (`structkv bench --weights int8`). Eager, it would materialise the float weight: only for
    graphs."""
    return (codes.float() * x).sum(-1)[None] * scales.float()  # (N, K) * (1, K) -> (N,) -> (1, N)


@torch.library.custom_op("structkv::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_product` as an opaque op (for a graph compiled for any prompt length)."""
    return int8_product(x, codes, scales)


@int8_linear.register_fake
def _(x, codes, scales):
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.custom_op("structkv::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """`int4_product` as an opaque op (for a graph compiled for any prompt length)."""
    return int4_product(x, packed, scale_zero, group)


@int4_linear.register_fake
def _(x, packed, scale_zero, group):
    return x.new_empty(x.shape[0], scale_zero.shape[1])


def int4_weight(packed: torch.Tensor, scale_zero: torch.Tensor, group: int, in_features: int) -> torch.Tensor:
    """The (N, K) bf16 weight the int4 kernel multiplies by: the kernel applied to the identity
    (the packing is the kernel's own, so it is the one reader that knows it)."""
    identity = torch.eye(in_features, dtype=torch.bfloat16, device=packed.device)  # (K, K)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, group, scale_zero).t()  # (K, N) -> (N, K)
