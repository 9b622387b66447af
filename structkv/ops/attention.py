"""Self-attention of the prompt pass as opaque ops: `structkv::causal_attention` (full-attention
layers) and `structkv::sliding_window_attention` (sliding-window layers), and `visible`, the mask
rule every attention in structkv follows; `decode_attention`, one query token over a float cache.

Both ops work blockwise (no (S, S) mask; sliding layers in O(S * (window + block))). Their block arithmetic
on a dynamic length would add shape guards to a compiled prefill, so they are registered with
torch.library (a fake implementation gives the output shape) and stay opaque to inductor; one
compiled layer graph then serves every prompt length. Masks come from original positions
(-1 = padding), so any token subset attends exactly as in the full prompt. See docs/ops.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query may attend to, from original positions.

    q_pos: (B, S); k_pos: (B, T) or (B, Hkv, T), -1 for padding / empty slots.
    Returns bool (B, 1, S, T) or (B, Hkv, S, T). A key is visible iff it is valid, not in the
    future of the query, and (sliding layers) fewer than `window` positions behind it.
    """
    if k_pos.dim() == 2:
        k_pos = k_pos[:, None]  # (B, 1, T)
    q = q_pos[:, None, :, None]  # (B, 1, S, 1)
    k = k_pos[:, :, None, :]  # (B, H, 1, T)
    mask = (k >= 0) & (k <= q)
    if sliding_window is not None:
        mask = mask & (q - k < sliding_window)
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """SDPA of q (B, Hq, S, D) over k, v (B, Hkv, T, D) with a bool mask (B, 1|Hkv|Hq, S, T).

    Why not always `enable_gqa=True`: on CUDA the flash kernel refuses a mask and the
    memory-efficient one refuses grouped heads, so SDPA falls back to the math kernel, which
    materialises (B, Hq, S, T) float32 scores (a 2048-query block at 64K on Llama-3.1-8B: 17 GB).
    There the KV heads are repeated to Hq first (a (B, Hq, T, D) copy: 1 GB at 64K), which the
    memory-efficient kernel takes with the mask. CPU's flash kernel takes both, so CPU reads K/V
    in place.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if mask.shape[1] not in (1, Hq):
        mask = mask.repeat_interleave(Hq // mask.shape[1], dim=1)  # per KV head -> per query head
    if q.device.type != "cuda" or Hq == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)  # -> (B, Hq, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


SLIDING_BLOCK = 32  # queries per block of sliding-window prefill on CPU
CUDA_SLIDING_BLOCK = 1024  # ... and on CUDA, one masked call per block (`_sliding_by_blocks`)


def sliding_self_attention(q, k, v, positions: torch.Tensor, sliding_window: int, scale: float,
                           block: int = SLIDING_BLOCK) -> torch.Tensor:
    """Self-attention of a sliding-window layer in blocks of `block` queries over the `window` +
    `block` keys that can reach them: O(S * (W + block)), not O(S^2).

    q (B, Hq, S, D), k, v (B, Hkv, S, D), positions (B, S) -> (B, Hq, S, D). Exact for any token
    subset: positions increase with the index, so a key fewer than W positions back is fewer than
    W indices back, i.e. among the W indices before the query's block or in it. Why small blocks:
    each query's keys are read and masked once per block it belongs to, so a block of W queries
    over 2W keys spends half its work on masked pairs; measured on the 2-core reference machine
    (Gemma 3 270M's shape, W 512, 8K tokens, a throwaway microbenchmark), one layer took 249-284 ms
    in blocks of 512 and 157-166 ms in blocks of 16-64 (32 chosen: best at 4K, 62 vs 112 ms).
    Registered as an opaque op (`structkv::sliding_window_attention`) so a compiled prefill stays
    dynamic in S.
    """
    B, Hq, S, D = q.shape
    Hkv, W = k.shape[1], sliding_window
    if S <= W + block:  # short: one masked call reads no more pairs than the blocks would
        return masked_attention(q, k, v, visible(positions, positions, W), scale)
    if q.device.type == "cuda":
        return _sliding_by_blocks(q, k, v, positions, W, scale)
    nb, L = (S + block - 1) // block, W + block
    pad = nb * block - S
    q = F.pad(q, (0, 0, 0, pad))  # (B, Hq, nb*block, D)
    k = F.pad(k, (0, 0, W, pad))  # W empty keys in front: (B, Hkv, W + nb*block, D)
    v = F.pad(v, (0, 0, W, pad))
    q_pos = F.pad(positions, (0, pad), value=-1)  # (B, nb*block)
    k_pos = F.pad(positions, (W, pad), value=-1)  # (B, W + nb*block)
    qb = q.view(B, Hq, nb, block, D).transpose(1, 2).reshape(B * nb, Hq, block, D)  # (B*nb, Hq, block, D)
    kb = k.unfold(2, L, block).permute(0, 2, 1, 4, 3).reshape(B * nb, Hkv, L, D)  # (B*nb, Hkv, L, D)
    vb = v.unfold(2, L, block).permute(0, 2, 1, 4, 3).reshape(B * nb, Hkv, L, D)
    mask = visible(q_pos.view(B * nb, block), k_pos.unfold(1, L, block).reshape(B * nb, L), W)  # (B*nb, 1, block, L)
    out = masked_attention(qb, kb, vb, mask, scale)
    return out.view(B, nb, Hq, block, D).transpose(1, 2).reshape(B, Hq, nb * block, D)[:, :, :S]  # (B, Hq, S, D)


def _sliding_by_blocks(q, k, v, positions, W: int, scale: float, block: int = CUDA_SLIDING_BLOCK):
    """The sliding layer on CUDA: one masked call per block of queries over the W keys before it
    and its own. The CPU path's all-blocks-at-once unfold copies K/V (W + block) / block times (17x
    at W 512) and, with grouped heads, G times more; here each call copies only its own keys."""
    outs = []
    for start in range(0, q.shape[2], block):
        end = min(q.shape[2], start + block)
        first = max(0, start - W)
        mask = visible(positions[:, start:end], positions[:, first:end], W)  # (B, 1, block, W + block)
        outs.append(masked_attention(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], mask, scale))
    return torch.cat(outs, dim=2)


@torch.library.custom_op("structkv::sliding_window_attention", mutates_args=())
def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             sliding_window: int, scale: float) -> torch.Tensor:
    return sliding_self_attention(q, k, v, positions, sliding_window, scale).contiguous()


def _shaped_like_q(q, *args):
    """Fake (meta) implementation of both attention ops: the output has q's shape."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


sliding_window_attention.register_fake(_shaped_like_q)


CAUSAL_BLOCK = 2048  # queries per block of full-attention prefill


def rows_in_order(positions: torch.Tensor) -> bool:
    """Whether every row is unpadded with increasing positions (so the mask is the causal
    triangle): one host read, which `Decoder.run` makes once per set of positions, not per layer."""
    return bool(((positions[:, :1] >= 0).all() & (positions[:, 1:] > positions[:, :-1]).all()))


def causal_self_attention(q, k, v, positions: torch.Tensor, scale: float, block: int = CAUSAL_BLOCK,
                          ordered: bool | None = None) -> torch.Tensor:
    """Self-attention of a full-attention layer without an (S, S) mask. Rows without padding whose
    positions increase (a whole prompt, or a kept subset of one) take SDPA's causal path; otherwise
    blocks of `block` queries attend over the keys up to the block's end with a (block, end) mask.

    q (B, Hq, S, D), k, v (B, Hkv, S, D), positions (B, S) -> (B, Hq, S, D). Exact for any token
    subset whose positions increase with the index (padding, -1, first): a key after a query's
    block is in its future. Registered as an opaque op (`structkv::causal_attention`). `ordered`:
    `rows_in_order(positions)` when the caller knows it (None: read here, one host read).
    """
    S = q.shape[2]
    if ordered is None:
        ordered = rows_in_order(positions)
    if ordered:
        # No padding and increasing positions: position order is index order, so the mask is the
        # causal triangle and SDPA's causal kernels skip the future blocks without any mask.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    outs = []  # one block when S <= block
    for start in range(0, S, block):
        end = min(S, start + block)
        mask = visible(positions[:, start:end], positions[:, :end], None)  # (B, 1, block, end)
        outs.append(masked_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask, scale))
    return torch.cat(outs, dim=2)


@torch.library.custom_op("structkv::causal_attention", mutates_args=())
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                     block: int, ordered: bool | None = None) -> torch.Tensor:
    return causal_self_attention(q, k, v, positions, scale, block, ordered).contiguous()


causal_attention.register_fake(_shaped_like_q)


SPLIT_BYTES = 1 << 20  # keys + values per split at least this (1 MiB): smaller splits cost more than they gain


def decode_splits(k: torch.Tensor, threads: int) -> int:
    """How many key ranges one decode attention reads in parallel (flash-decoding): 1 off the CPU
    or under two threads; else the largest power of two <= 2 x threads whose ranges still hold
    `SPLIT_BYTES` of keys and values and divide the cache. Why: on CPU, SDPA runs one task per
    (row, KV head), so a single-row decode of a model with 1-3 KV heads leaves threads idle; measured
    on the 2-core reference machine (a throwaway microbenchmark, one step's attention per layer):
    Gemma 3 270M at 4352 slots 815 -> 479 us (2 ranges), SmolLM2 at 4096 706 -> 422 us (4), while
    1 MiB and less gains nothing."""
    if threads < 2 or k.device.type != "cpu":
        return 1
    total, slots, splits = 2 * k.numel() * k.element_size(), k.shape[2], 1
    while 2 * splits <= 2 * threads and total // (2 * splits) >= SPLIT_BYTES and slots % (2 * splits) == 0:
        splits *= 2
    return splits


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, threads: int = 1) -> torch.Tensor:
    """One query token per row over float k, v: q (B, Hq, 1, D), k, v (B, Hkv, T, D), mask
    (B, 1|Hkv, 1, T) -> (B, Hq, 1, D). The G query heads of a KV head go as G query rows, so k and v
    are read in place (SDPA's enable_gqa on CPU would copy them G times). With `threads` > 1 on CPU
    a long cache is read in `decode_splits` key ranges at once (`split_decode_attention`)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    splits = decode_splits(k, threads)
    if splits > 1 and k.is_contiguous() and v.is_contiguous():
        return split_decode_attention(q, k, v, mask, scale, splits)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k, v, attn_mask=mask,
                                         scale=scale)  # (B, Hkv, G, D)
    return out.reshape(B, Hq, 1, D)


def split_decode_attention(q, k, v, mask, scale: float, splits: int) -> torch.Tensor:
    """`decode_attention` as `splits` attentions over consecutive key ranges, run as one CPU flash
    call (each range a head of its own: a view of the contiguous cache, no copy), then merged by
    their log-sum-exps. A range with no visible key has weight 0 (the kernel returns 0 and lse 0 for
    it, so its lse is set to -inf here)."""
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, n = Hq // Hkv, T // splits
    qs = q.reshape(B, Hkv, 1, G, D).expand(B, Hkv, splits, G, D).reshape(B, Hkv * splits, G, D)
    ks, vs = k.view(B, Hkv * splits, n, D), v.view(B, Hkv * splits, n, D)  # (B, Hkv, S*n, D) -> (B, Hkv*S, n, D)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = bias.expand(B, Hkv, 1, T).reshape(B, Hkv * splits, 1, n)  # (B, 1|Hkv, 1, T) -> (B, Hkv*S, 1, n)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, attn_mask=bias,
                                                                           scale=scale)[:2]
    out, lse = out.view(B, Hkv, splits, G, D), lse.view(B, Hkv, splits, G)
    seen = mask.reshape(B, mask.shape[1], splits, n).any(-1)  # (B, 1|Hkv, S): the kernel gives a blind range lse 0
    lse = lse.masked_fill(~seen[..., None], float("-inf"))
    weight = lse.softmax(2)[..., None]  # (B, Hkv, S, G, 1): each range's share of the softmax mass
    merged = torch.where(weight > 0, out * weight, torch.zeros_like(out)).sum(2)  # (B, Hkv, G, D)
    return merged.reshape(B, Hq, 1, D)
