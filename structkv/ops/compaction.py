"""`structkv::compact_kv`: write the selected entries of a layer's K/V into preallocated cache buffers.

Every compression method ends the same way: per (batch row, KV head), a sorted list of kept token
indices. This op gathers those keys, values and their original positions into slots [0, M) of
fixed-capacity buffers, in place, and marks the rest empty (position -1); a head's entry count is
its valid positions (the cache keeps one cursor for every head). Index lists may end with -1
entries ("nothing here"), so rows with fewer valid tokens (left padding) share one static shape.

CPU: aten gather; CUDA: a Triton gather kernel (`structkv.ops.triton_kernels`).
"""
from __future__ import annotations

import torch


def compact_kv_reference(k_cache, v_cache, pos_cache, k, v, k_pos, indices) -> None:
    M, D = indices.shape[-1], k.shape[-1]
    valid = indices >= 0  # (B, Hkv, M)
    idx = indices.clamp_min(0)
    gather = idx[..., None].expand(-1, -1, -1, D)  # (B, Hkv, M, D)
    zero = torch.zeros((), dtype=k_cache.dtype, device=k_cache.device)
    k_cache[:, :, :M] = torch.where(valid[..., None], k.gather(2, gather).to(k_cache.dtype), zero)
    v_cache[:, :, :M] = torch.where(valid[..., None], v.gather(2, gather).to(v_cache.dtype), zero)
    pos = k_pos[:, None].expand(-1, indices.shape[1], -1)  # (B, Hkv, N)
    pos_cache[:, :, :M] = torch.where(valid, pos.gather(2, idx), torch.full_like(idx, -1))
    pos_cache[:, :, M:] = -1


@torch.library.custom_op("structkv::compact_kv", mutates_args={"k_cache", "v_cache", "pos_cache"})
def _compact_kv_op(k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, indices: torch.Tensor) -> None:
    if k.device.type == "cuda":
        from .triton_kernels import compact_kv_triton

        compact_kv_triton(k_cache, v_cache, pos_cache, k, v, k_pos, indices)
    else:
        compact_kv_reference(k_cache, v_cache, pos_cache, k, v, k_pos, indices)


def _check(k_cache, v_cache, pos_cache, k, v, k_pos, indices, check_values: bool):
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be (B, Hkv, N, D); got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, N, D = k.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D:
        raise ValueError(f"caches must be (B, Hkv, capacity, D) = ({B}, {H}, C, {D}); got k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    C = k_cache.shape[2]
    if tuple(pos_cache.shape) != (B, H, C):
        raise ValueError(f"pos_cache must be (B, Hkv, C) = {(B, H, C)}; got {tuple(pos_cache.shape)}")
    if tuple(k_pos.shape) != (B, N):
        raise ValueError(f"k_pos must be (B, N) = {(B, N)}, got {tuple(k_pos.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != (B, H):
        raise ValueError(f"indices must be (B, Hkv, M) with (B, Hkv) = {(B, H)}, got {tuple(indices.shape)}")
    if indices.shape[2] > C:
        raise ValueError(f"{indices.shape[2]} selected entries do not fit a cache of capacity {C}")
    for name, t in (("indices", indices), ("k_pos", k_pos), ("pos_cache", pos_cache)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    if not (k.dtype.is_floating_point and k_cache.dtype.is_floating_point) and k.dtype != k_cache.dtype:
        raise ValueError(f"k/v and caches must be floating point, or the same integer dtype (quantized codes), "
                         f"got {k.dtype} and {k_cache.dtype}")
    if check_values and indices.numel():
        valid = indices >= 0
        if bool((indices >= N).any()):
            raise ValueError(f"indices must be < N = {N}; max is {int(indices.max())}")
        if bool((valid[..., 1:] & ~valid[..., :-1]).any()):
            raise ValueError("indices: -1 ('no entry') may only appear at the end of each list")
        both = valid[..., 1:] & valid[..., :-1]
        if bool((both & (indices[..., 1:] <= indices[..., :-1])).any()):
            raise ValueError("indices must be strictly increasing (sorted, unique) per (batch, KV head)")


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, indices: torch.Tensor, *,
               check: bool = True) -> None:
    """Fill cache slots [0, M) with the selected entries, in place.

    Args:
        k_cache, v_cache: (B, Hkv, C, D) preallocated buffers (written).
        pos_cache: (B, Hkv, C) int64 original positions (written; -1 = empty slot).
        k, v: (B, Hkv, N, D) the layer's keys (RoPE applied) and values.
        k_pos: (B, N) int64 original positions of the N tokens.
        indices: (B, Hkv, M) int64, M <= C, strictly increasing per row, -1 allowed at the tail.
        check: validate index lists (a host sync; skipped automatically under torch.compile).
    """
    check_values = check and not torch.compiler.is_compiling()
    _check(k_cache, v_cache, pos_cache, k, v, k_pos, indices, check_values)
    _compact_kv_op(k_cache, v_cache, pos_cache, k, v, k_pos, indices)
