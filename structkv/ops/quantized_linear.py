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

import functools

import torch
import torch.nn.functional as F

from .int8_head import int8_block_row

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
    graphs. The LM head's reduction with one block per row."""
    return int8_block_row(x, codes, scales.float()[:, None])  # scales (N,) -> (N, 1): one block


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
    """The (N, K) bf16 weight the int4 kernel multiplies by. Where this build packs in its AVX-512
    layout (`avx512_packing`, checked once on a probe) the codes are read straight from the bytes;
    otherwise the kernel is applied to the identity (the packing is the kernel's own, so it is the
    one reader that knows it). Why both: the identity costs an (K, K) x (K, N) product through the
    packed kernel, measured as most of an int4 prompt's extra time over int8 (Gemma 3 270M, 4K)."""
    N = scale_zero.shape[1]
    if packed.device.type == "cpu" and N % AVX512_ROWS == 0 and avx512_packing():
        codes = avx512_codes(packed, N, in_features).view(N, in_features // group, group).float()  # (N, G, group)
        table = scale_zero.float().transpose(0, 1)  # (G, N, 2) -> (N, G, 2)
        w = (codes - 8) * table[..., :1] + table[..., 1:]  # the kernel's (code - 8) * scale + zero
        return w.view(N, in_features).to(torch.bfloat16)
    identity = torch.eye(in_features, dtype=torch.bfloat16, device=packed.device)  # (K, K)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, group, scale_zero).t()  # (K, N) -> (N, K)


AVX512_ROWS = 64  # rows per block of the AVX-512 int4 packing


def avx512_codes(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """(N, K) uint8 codes 0..15 of an int4 packing in PyTorch's AVX-512 CPU layout: rows in blocks
    of 64, and per block and input column 32 bytes, byte d < 16 holding rows d (low nibble) and
    d + 32 (high), byte 16 + d rows 16 + d and 48 + d."""
    b = packed.view(torch.uint8).reshape(N // AVX512_ROWS, K, 32)  # (NB, K, 32)
    low, high = b & 15, b >> 4
    rows = torch.cat([low[..., :16], low[..., 16:], high[..., :16], high[..., 16:]], -1)  # (NB, K, 64): rows 0..63
    return rows.transpose(1, 2).reshape(N, K)  # (NB, 64, K) -> (N, K)


@functools.cache
def avx512_packing() -> bool:
    """Whether `aten._convert_weight_to_int4pack_for_cpu` packs in the layout `avx512_codes` reads
    (it depends on the CPU capability PyTorch dispatches to): checked once per process on a probe
    of every code in every position class."""
    probe = (torch.arange(AVX512_ROWS)[:, None] * 5 + torch.arange(64)[None] * 3).remainder(16).int()  # (64, 64)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    return packed.numel() == probe.numel() // 2 and torch.equal(avx512_codes(packed, 64, 64).int(), probe)
