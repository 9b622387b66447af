"""Quantized KV entries and `structkv::quantized_decode_attention`, the decode attention that reads them.

A cache of `kv_dtype` "bf16" stores its entries in bfloat16 whatever the model's dtype (half a
float32 cache's bytes, no tables: the 16-bit cache llama.cpp and the serving engines keep by
default, so a float32 model is compared with them on the same bytes). "int8" or "int4" store every
(token, KV head) entry as codes plus its own scale (int4: and minimum), so one outlier token or
head never costs the others their precision:
- int8: symmetric, codes in [-127, 127], x ~ code * scale, scale = max|x| / 127;
- int4: asymmetric per group of `INT4_GROUP` dimensions (16 levels cannot span a head whose few
  outlier channels are 10x the rest: one scale per head measured KL 0.76 against the float cache
  on Gemma 3 270M, groups of 32 far less, research/benchmarks_log.md), codes in [0, 15],
  x ~ code * scale + min, scale = (max - min) / 15; two codes per byte, dimension j in the low
  nibble and j + D/2 in the high one (a kernel then reads two contiguous halves, no interleaving).
Scales are bfloat16 (2 bytes, float32's range) rounded up, so no code is clipped; int4 minima
float32: int8 entries take D + 2 bytes per head and token against 2D (bf16) or 4D (fp32); int4
entries D/2 + 6 D/32.

`quantize_int4_channels`: int4 with a scale and minimum per channel over blocks of entries
instead, for an archive's keys (`structkv.models.archive`; a cache appends one entry at a time, so
its entries keep per-entry tables).

Each kind is a tuple of planes of one shape (..., last): the codes (..., D or D/2) and (..., 1)
scale tables, so caches move and compact every plane the same way as float k and v.

`quantized_decode_attention`: one query token over the quantized cache, opaque to a compiled
decode step: the CPU implementation is the reference (dequantize, then the float decode
attention); CUDA runs a Triton kernel that dequantizes tile by tile in registers
(`structkv.ops.triton_kernels.quantized_decode_attention_triton`), never the whole cache.
"""
from __future__ import annotations

import torch

from .attention import decode_attention

KV_DTYPES = ("bf16", "int8", "int4")
# Planes of each kind after the codes: names suffixed to "k" / "v" in a cache, and their dtypes.
TABLES = {"bf16": (), "int8": ("_scale",), "int4": ("_scale", "_min")}
# A minimum is kept exactly: values far from zero next to their spread (a bfloat16 minimum of
# -85620 is off by up to 512) would otherwise lose the whole int4 grid.
TABLE_DTYPES = {"_scale": torch.bfloat16, "_min": torch.float32}
INT4_GROUP = 32  # dimensions per int4 scale and minimum (the whole head when it does not divide it)
SCALE_DTYPE = torch.bfloat16  # the range of float32: no entry overflows its table
CHANNEL_BLOCK = 32  # entries per table of per-channel int4 (an archive's keys)


def check_kv_dtype(kv_dtype) -> None:
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (the model's float dtype), 'bf16', 'int8' or 'int4', got {kv_dtype!r}")


def code_width(kv_dtype: str, head_dim: int) -> int:
    """Last dimension of the code plane: D (bf16, int8) or D / 2 (int4, two codes per byte)."""
    if kv_dtype == "int4" and head_dim % 2:
        raise ValueError(f"int4 KV packs two dimensions per byte: head_dim must be even, got {head_dim}")
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def table_width(kv_dtype: str, head_dim: int) -> int:
    """Last dimension of the scale (and minimum) tables: 1 (int8) or one per int4 group."""
    return head_dim // int4_group(head_dim) if kv_dtype == "int4" else 1


def int4_group(head_dim: int) -> int:
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def code_dtype(kv_dtype: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "int8": torch.int8}.get(kv_dtype, torch.uint8)


def _scale(x: torch.Tensor) -> torch.Tensor:
    """A step (float32) as a bfloat16 scale rounded up, never to nearest: it still spans the
    entry's values, so no code is clipped and every value is within half a step."""
    t = x.to(SCALE_DTYPE)
    return torch.where(t.float() < x, torch.nextafter(t, torch.full_like(t, float("inf"))), t)


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, ...]:
    """x (..., D) float -> the planes (codes, scale[, min]) of `kv_dtype`, each (..., last)."""
    if kv_dtype == "bf16":
        return (x.to(torch.bfloat16),)
    x = x.float()
    tiny = torch.finfo(torch.float32).tiny
    if kv_dtype == "int8":
        scale = _scale(x.abs().amax(-1, keepdim=True) / 127)  # (..., 1)
        return torch.round(x / scale.float().clamp_min(tiny)).clamp(-127, 127).to(torch.int8), scale
    D = x.shape[-1]
    codes, scale, lo = _int4_grid(x.unflatten(-1, (D // int4_group(D), int4_group(D))), -1)  # over (..., G, group)
    return _pack4(codes.flatten(-2)), scale, lo  # codes (..., D) -> (..., D/2)


def _int4_grid(g: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of float32 `g` over dimension `dim` (a group of dimensions, or a block
    of entries): codes (g's shape, uint8 in [0, 15]), the bf16 scale rounded up and the exact
    float32 minimum (g's shape without `dim`)."""
    lo = g.amin(dim)
    scale = _scale((g.amax(dim) - lo) / 15)
    tiny = torch.finfo(torch.float32).tiny
    codes = torch.round((g - lo.unsqueeze(dim)) / scale.float().clamp_min(tiny).unsqueeze(dim))
    return codes.clamp(0, 15).to(torch.uint8), scale, lo


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """codes (..., D) in [0, 15] -> (..., D/2): dimension j in the low nibble, j + D/2 in the high."""
    D = codes.shape[-1]
    return codes[..., :D // 2] | (codes[..., D // 2:] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 15, packed >> 4], -1).float()  # (..., D)


def quantize_int4_channels(x: torch.Tensor, block: int = CHANNEL_BLOCK) -> tuple[torch.Tensor, ...]:
    """x (A, ..., D) float, entries on the first dimension -> int4 codes (A, ..., D/2) and a scale and
    minimum per channel over each block of `block` entries, (ceil(A / block), ..., D) each.

    Why per channel: keys carry a few outlier channels whose magnitude is shared by every token
    (KIVI, Liu et al. 2024); per-entry groups spend their 16 levels spanning those channels and
    round the small ones to nothing, which is what moves a question's attention. Per channel over
    a block, every channel gets its own range: on Gemma 3 270M the question's attention KL at
    layer 5 drops from 0.18 to 0.012 nats for the same bytes (`research/experiments/archive_fidelity.py`).
    A last partial block is padded with copies of its last entry (stored tables only)."""
    A = x.shape[0]
    blocks = -(-A // block)
    x = x.float()
    padded = torch.cat([x, x[-1:].expand(blocks * block - A, *x.shape[1:])]) if A else x
    codes, scale, lo = _int4_grid(padded.reshape(blocks, block, *x.shape[1:]), 1)  # over (blocks, block, ..., D)
    return _pack4(codes.flatten(0, 1)[:A]), scale, lo


def dequantize_int4_channels(packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., D/2) with each entry's own channel tables (..., D) (a block's, repeated or
    gathered per entry) -> x (..., D) in `dtype`."""
    return (_unpack4(packed) * scale.float() + lo.float()).to(dtype)


def dequantize_kv(planes: tuple[torch.Tensor, ...] | list[torch.Tensor], kv_dtype: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The planes of `quantize_kv` -> x (..., D) in `dtype`."""
    if kv_dtype == "bf16":
        return planes[0].to(dtype)
    if kv_dtype == "int8":
        codes, scale = planes
        return (codes.float() * scale.float()).to(dtype)
    packed, scale, lo = planes
    codes = _unpack4(packed)  # (..., D)
    g = codes.unflatten(-1, (scale.shape[-1], -1))  # (..., G, group)
    return (g * scale.float()[..., None] + lo.float()[..., None]).flatten(-2).to(dtype)


def quantized_decode_attention_reference(q, k, v, mask, scale: float, kv_dtype: str) -> torch.Tensor:
    """Dequantize every entry to q's dtype, then `decode_attention`: the definition the kernels
    are tested against. k, v: the planes of `quantize_kv`, each (B, Hkv, T, last)."""
    return decode_attention(q, dequantize_kv(k, kv_dtype, q.dtype), dequantize_kv(v, kv_dtype, q.dtype), mask, scale,
                            torch.get_num_threads())


@torch.library.custom_op("structkv::quantized_decode_attention", mutates_args=())
def quantized_decode_attention(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], mask: torch.Tensor,
                               scale: float, kv_dtype: str) -> torch.Tensor:
    """q (B, Hq, 1, D) over quantized k, v planes (B, Hkv, T, last) with a bool mask (B, 1|Hkv, 1, T)
    -> (B, Hq, 1, D) in q's dtype."""
    if q.device.type == "cuda" and kv_dtype != "bf16":  # bf16 entries: the reference (one cast per step)
        from .triton_kernels import quantized_decode_attention_triton

        return quantized_decode_attention_triton(q, k, v, mask, scale, kv_dtype)
    return quantized_decode_attention_reference(q, k, v, mask, scale, kv_dtype).contiguous()


@quantized_decode_attention.register_fake
def _(q, k, v, mask, scale, kv_dtype):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
