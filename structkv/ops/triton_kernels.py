"""Triton kernels behind `structkv::window_scores`, `structkv::compact_kv` and
`structkv::quantized_decode_attention`.

Imported lazily (only on CUDA, or by tests under TRITON_INTERPRET=1), never at package import.
Kernel arguments: pointers, sizes, strides, then UPPERCASE constexprs. Each wrapper takes its
block sizes and grid from a `*_config` function, which `structkv.ops.triton_aot` also reads to
compile the same kernels ahead of time for a GPU target (registers, spills, tensor cores).

Precision: the logits of window_scores are one `tl.dot` on the inputs' own dtype with float32
accumulation. A bf16 or fp16 product is exact in float32, so this equals the float32 reference up
to summation order and runs on tensor cores; float32 inputs use the exact "ieee" dot on smaller
tiles (it keeps every product in registers). Everything after the dot is float32.

Offsets: the batch and head indices are int64, so `b * stride` never wraps past 2^31 elements.

window_scores is two passes, as in the CPU reference:
  1. `_window_stats`: per (batch, query head, block of window queries, split of the keys), stream
     over key blocks keeping the running max, sum of exp and sum of exp * logit; the splits'
     partials are merged in torch -> logsumexp and entropy. Splitting the keys fills the GPU at
     batch 1 (Llama-8B: 32 query heads against 132 SMs).
  2. `_window_saliency`: per (batch, KV head, block of keys), for each query head of the group,
     exp(logit - logsumexp) summed over the window -> saliency / w.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 2  # split the keys until the grid has this many programs per SM
MIN_BLOCKS_PER_SPLIT = 4  # ... but never below this many key blocks per split


@triton.jit
def _logits_tile(q, k, qp, kp, scale, sliding_window, softcap, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(BLOCK_W, BLOCK_N) float32 logits and visibility for a q tile and a k tile (same dtype)."""
    x = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=tl.float32) * scale
    if HAS_SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # softcap * tanh(x / softcap)
    vis = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    if HAS_WINDOW:
        vis = vis & (qp[:, None] - kp[None, :] < sliding_window)
    return x, vis


@triton.jit
def _window_stats(Q, K, QPOS, KPOS, M_OUT, L_OUT, E_OUT,
                  Hq, W, N, D, chunk, scale, sliding_window, softcap,
                  sqb, sqh, sqw, sqd, skb, skh, skn, skd, sqpb, sqpw, skpb, skpn,
                  GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """Partials of keys [split * chunk, (split + 1) * chunk) into (B, Hq, splits, W) rows."""
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    b, h = pid // Hq, pid % Hq
    hk = h // GROUP
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    w_ok = offs_w < W
    q = tl.load(Q + b * sqb + h * sqh + offs_w[:, None] * sqw + offs_d[None, :] * sqd,
                mask=w_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    qp = tl.load(QPOS + b * sqpb + offs_w * sqpw, mask=w_ok, other=-1)
    m = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    e = tl.zeros([BLOCK_W], tl.float32)
    for start in range(split * chunk, tl.minimum(split * chunk + chunk, N), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        kp = tl.load(KPOS + b * skpb + offs_n * skpn, mask=n_ok, other=-1)
        x, vis = _logits_tile(q, k, qp, kp, scale, sliding_window, softcap, HAS_WINDOW, HAS_SOFTCAP)
        x_masked = tl.where(vis, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x_masked, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        p = tl.where(vis, tl.exp(x - m_safe[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        if WITH_ENTROPY:
            e = e * alpha + tl.sum(p * tl.where(vis, x, 0.0), 1)
        m = m_new
    out = (pid * tl.num_programs(2) + split) * W + offs_w  # partials are contiguous (B, Hq, splits, W)
    tl.store(M_OUT + out, m, mask=w_ok)
    tl.store(L_OUT + out, l, mask=w_ok)
    if WITH_ENTROPY:
        tl.store(E_OUT + out, e, mask=w_ok)


@triton.jit
def _window_saliency(Q, K, QPOS, KPOS, LSE, SAL,
                     Hq, Hkv, W, N, D, scale, sliding_window, softcap,
                     sqb, sqh, sqw, sqd, skb, skh, skn, skd, sqpb, sqpw, skpb, skpn,
                     GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, hk = pid // Hkv, pid % Hkv
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    kp = tl.load(KPOS + b * skpb + offs_n * skpn, mask=n_ok, other=-1)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            w_ok = offs_w < W
            q = tl.load(Q + b * sqb + h * sqh + offs_w[:, None] * sqw + offs_d[None, :] * sqd,
                        mask=w_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            qp = tl.load(QPOS + b * sqpb + offs_w * sqpw, mask=w_ok, other=-1)
            lse = tl.load(LSE + (b * Hq + h) * W + offs_w, mask=w_ok, other=float("inf"))
            x, vis = _logits_tile(q, k, qp, kp, scale, sliding_window, softcap, HAS_WINDOW, HAS_SOFTCAP)
            p = tl.where(vis, tl.exp(x - lse[:, None]), 0.0)
            acc += tl.sum(p, 0)
    tl.store(SAL + pid * N + offs_n, acc / W, mask=n_ok)


def window_config(w: int, d: int, dtype: torch.dtype) -> dict:
    """Block sizes of both window_scores passes. Float32 tiles are smaller: the exact dot keeps
    every product in registers, and larger tiles spill (checked by tests/test_triton_aot.py)."""
    block_d = max(16, triton.next_power_of_2(d))
    if dtype == torch.float32:
        return dict(BLOCK_W=16, BLOCK_N=16 if block_d > 64 else 32, BLOCK_D=block_d,
                    num_warps=8 if block_d > 128 else 4)
    block_w = min(64, max(16, triton.next_power_of_2(w)))
    return dict(BLOCK_W=block_w, BLOCK_N=64 if block_d <= 128 else 32, BLOCK_D=block_d)


def key_splits(programs: int, key_blocks: int, sm_count: int) -> int:
    """How many parts the first pass splits the keys into: enough for PROGRAMS_PER_SM programs on
    every SM, never fewer than MIN_BLOCKS_PER_SPLIT key blocks per part, at least 1."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(programs, 1))
    return max(1, min(wanted, key_blocks // MIN_BLOCKS_PER_SPLIT))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _split_weights(m, l):
    """Partials over dim 2 (the key splits) of an online softmax: their running max `m` and sum of
    exp `l` -> (the overall max, 0 where every split is empty; each split's weight exp(m - max),
    0 for an empty one; the overall sum of exp), max and sum with dim 2 reduced."""
    top = m.amax(2)
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(m - top_safe.unsqueeze(2))  # -inf partials weigh 0
    return top_safe, weight, (l * weight).sum(2)


def _merge_stats(m, l, e, entropy: bool):
    """(B, Hq, splits, W) partial max / sum of exp / sum of exp * logit -> logsumexp (+inf where no
    key is visible) and entropy (B, Hq, W)."""
    top_safe, weight, total = _split_weights(m, l)
    seen = total > 0
    lse = torch.where(seen, top_safe + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, float("inf")))
    if not entropy:
        return lse, total.new_zeros(total.shape[:2] + (0,))
    mean_logit = (e * weight).sum(2) / torch.where(seen, total, torch.ones_like(total))
    return lse, torch.where(seen, (lse - mean_logit).clamp_min(0.0), torch.zeros_like(total))


def window_scores_triton(q, k, q_pos, k_pos, scale: float, sliding_window: int, softcap: float, entropy: bool = True,
                         splits: int | None = None):
    """Launch both passes. q (B, Hq, w, D), k (B, Hkv, N, D), q_pos (B, w), k_pos (B, N) int64.

    Returns saliency (B, Hkv, N) and entropy (B, Hq, w) ((B, Hq, 0) unless `entropy`), float32;
    any strides are accepted. `splits`: parts of the keys in the first pass (default: enough to
    fill the device, `key_splits`).
    """
    B, Hq, W, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0 and k.shape[0] == B and k.shape[3] == D
    assert q_pos.shape == (B, W) and k_pos.shape == (B, N)
    dtype = q.dtype if q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, k = q.to(dtype), k.to(dtype)  # one dtype for tl.dot; no copy when it already is
    sal = torch.empty((B, Hkv, N), dtype=torch.float32, device=q.device)
    if B * Hq * W == 0 or N == 0:
        return sal.zero_(), torch.zeros((B, Hq, W if entropy else 0), dtype=torch.float32, device=q.device)
    blocks = window_config(W, D, dtype)
    w_blocks, n_blocks = triton.cdiv(W, blocks["BLOCK_W"]), triton.cdiv(N, blocks["BLOCK_N"])
    splits = splits or key_splits(B * Hq * w_blocks, n_blocks, _sm_count(q.device))
    chunk = triton.cdiv(n_blocks, splits) * blocks["BLOCK_N"]
    splits = triton.cdiv(N, chunk)  # no empty split
    m, l, e = (torch.empty((B, Hq, splits, W), dtype=torch.float32, device=q.device) for _ in range(3))
    strides = (*q.stride(), *k.stride(), *q_pos.stride(), *k_pos.stride())
    flags = dict(GROUP=Hq // Hkv, HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=softcap > 0, **blocks)
    _window_stats[(B * Hq, w_blocks, splits)](
        q, k, q_pos, k_pos, m, l, e, Hq, W, N, D, chunk, scale, sliding_window, softcap, *strides,
        WITH_ENTROPY=entropy, **flags)
    lse, ent = _merge_stats(m, l, e, entropy)
    _window_saliency[(B * Hkv, n_blocks)](
        q, k, q_pos, k_pos, lse, sal, Hq, Hkv, W, N, D, scale, sliding_window, softcap, *strides, **flags)
    return sal, ent


@triton.jit
def _compact(K, V, KPOS, IDX, KC, VC, PC,
             Hkv, M, D,
             skb, skh, skn, skd, svb, svh, svn, svd, skpb, skpn, sib, sih, sim,
             scb, sch, scc, scd, svcb, svch, svcc, svcd, spb, sph, spc,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, h = pid // Hkv, pid % Hkv
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    idx = tl.load(IDX + b * sib + h * sih + offs_m * sim, mask=m_ok, other=-1)
    valid = idx >= 0
    src = tl.where(valid, idx, 0)
    both = (valid & m_ok)[:, None] & (offs_d[None, :] < D)
    kt = tl.load(K + b * skb + h * skh + src[:, None] * skn + offs_d[None, :] * skd, mask=both, other=0.0)
    vt = tl.load(V + b * svb + h * svh + src[:, None] * svn + offs_d[None, :] * svd, mask=both, other=0.0)
    dst = m_ok[:, None] & (offs_d[None, :] < D)
    tl.store(KC + b * scb + h * sch + offs_m[:, None] * scc + offs_d[None, :] * scd, kt.to(KC.dtype.element_ty),
             mask=dst)
    tl.store(VC + b * svcb + h * svch + offs_m[:, None] * svcc + offs_d[None, :] * svcd, vt.to(VC.dtype.element_ty),
             mask=dst)
    pos = tl.load(KPOS + b * skpb + src * skpn, mask=valid & m_ok, other=-1)
    tl.store(PC + b * spb + h * sph + offs_m * spc, tl.where(valid, pos, -1), mask=m_ok)


def compact_config(d: int) -> dict:
    return dict(BLOCK_M=32, BLOCK_D=max(16, triton.next_power_of_2(d)))


def compact_kv_triton(k_cache, v_cache, pos_cache, k, v, k_pos, indices) -> None:
    """Gather kernel for `structkv::compact_kv` (same contract as the reference)."""
    B, H, N, D = k.shape
    M = indices.shape[2]
    if B * H * M:
        blocks = compact_config(D)
        _compact[(B * H, triton.cdiv(M, blocks["BLOCK_M"]))](
            k, v, k_pos, indices, k_cache, v_cache, pos_cache, H, M, D,
            *k.stride(), *v.stride(), *k_pos.stride(), *indices.stride(),
            *k_cache.stride(), *v_cache.stride(), *pos_cache.stride(), **blocks)
    pos_cache[:, :, M:] = -1


@triton.jit
def _dequant_tile(CODES, SCALE, MIN, row, offs_t, t_ok, offs_d, DC,
                  sc_t, sc_d, ss_t, ss_g, sm_t, sm_g, INT4: tl.constexpr, GROUP_D: tl.constexpr):
    """(BLOCK_T, BLOCK_D) float32 values of one code tile (int4: the low and the high halves, each
    dimension with its group's scale and minimum)."""
    ok = t_ok[:, None] & (offs_d[None, :] < DC)
    codes = tl.load(CODES + row + offs_t[:, None] * sc_t + offs_d[None, :] * sc_d, mask=ok, other=0).to(tl.int32)
    if INT4:
        g_lo, g_hi = offs_d[None, :] // GROUP_D, (offs_d[None, :] + DC) // GROUP_D  # each dimension's group
        s_lo = tl.load(SCALE + offs_t[:, None] * ss_t + g_lo * ss_g, mask=ok, other=0.0).to(tl.float32)
        s_hi = tl.load(SCALE + offs_t[:, None] * ss_t + g_hi * ss_g, mask=ok, other=0.0).to(tl.float32)
        m_lo = tl.load(MIN + offs_t[:, None] * sm_t + g_lo * sm_g, mask=ok, other=0.0).to(tl.float32)
        m_hi = tl.load(MIN + offs_t[:, None] * sm_t + g_hi * sm_g, mask=ok, other=0.0).to(tl.float32)
        return (codes & 15).to(tl.float32) * s_lo + m_lo, (codes >> 4).to(tl.float32) * s_hi + m_hi
    scale = tl.load(SCALE + offs_t * ss_t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    return codes.to(tl.float32) * scale, codes.to(tl.float32) * 0.0


@triton.jit
def _quantized_decode(Q, KC, KS, KM, VC, VS, VM, MASK, ACC, M_OUT, L_OUT,
                      Hq, T, DC, chunk, scale,
                      sqb, sqh, sqd, skb, skh, skt, skd, sksb, sksh, skst, sksg, skmb, skmh, skmt, skmg,
                      svb, svh, svt, svd, svsb, svsh, svst, svsg, svmb, svmh, svmt, svmg,
                      smb, smh, smt,
                      GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INT4: tl.constexpr,
                      GROUP_D: tl.constexpr):
    """One program per (batch row, query head, split of the cache): stream over the split's tiles
    with an online softmax, dequantizing each tile in registers; write the unnormalised sum and
    its max and sum of exp (merged in torch, as flash-decoding does)."""
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b, h = pid // Hq, pid % Hq
    hk = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DC
    q_lo = tl.load(Q + b * sqb + h * sqh + offs_d * sqd, mask=d_ok, other=0.0).to(tl.float32)
    q_hi = tl.load(Q + b * sqb + h * sqh + (offs_d + DC) * sqd, mask=d_ok & INT4, other=0.0).to(tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc_lo = tl.zeros([BLOCK_D], tl.float32)
    acc_hi = tl.zeros([BLOCK_D], tl.float32)
    for start in range(split * chunk, tl.minimum(split * chunk + chunk, T), BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        vis = tl.load(MASK + b * smb + hk * smh + offs_t * smt, mask=t_ok, other=0) != 0
        k_lo, k_hi = _dequant_tile(KC, KS + b * sksb + hk * sksh, KM + b * skmb + hk * skmh, b * skb + hk * skh,
                                   offs_t, t_ok, offs_d, DC, skt, skd, skst, sksg, skmt, skmg, INT4, GROUP_D)
        x = tl.sum(k_lo * q_lo[None, :], 1) + tl.sum(k_hi * q_hi[None, :], 1)
        x = tl.where(vis, x * scale, float("-inf"))  # (BLOCK_T,)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        p = tl.where(vis, tl.exp(x - m_safe), 0.0)  # (BLOCK_T,)
        v_lo, v_hi = _dequant_tile(VC, VS + b * svsb + hk * svsh, VM + b * svmb + hk * svmh, b * svb + hk * svh,
                                   offs_t, t_ok, offs_d, DC, svt, svd, svst, svsg, svmt, svmg, INT4, GROUP_D)
        acc_lo = acc_lo * alpha + tl.sum(v_lo * p[:, None], 0)
        acc_hi = acc_hi * alpha + tl.sum(v_hi * p[:, None], 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    row = pid * tl.num_programs(1) + split  # partials are contiguous: ACC (B, Hq, splits, 2 * DC)
    tl.store(ACC + row * 2 * DC + offs_d, acc_lo, mask=d_ok)
    tl.store(ACC + row * 2 * DC + DC + offs_d, acc_hi, mask=d_ok & INT4)
    zero = tl.arange(0, 1)
    tl.store(M_OUT + row + zero, m)
    tl.store(L_OUT + row + zero, l)


def decode_config(dc: int, int4: bool) -> dict:
    """Tiles of 32 cache entries, 16 past 64 code columns (a (32, 128) float32 tile pair spills)."""
    block_d = max(16, triton.next_power_of_2(dc))
    return dict(BLOCK_T=32 if block_d <= 64 else 16, BLOCK_D=block_d, INT4=int4)


def quantized_decode_attention_triton(q, k, v, mask, scale: float, kv_dtype: str,
                                      splits: int | None = None) -> torch.Tensor:
    """Kernel for `structkv::quantized_decode_attention` (same contract as the reference).
    `splits`: parts of the cache, each its own program (default: enough to fill the device)."""
    B, Hq, _, D = q.shape
    Hkv, T, DC = k[0].shape[1], k[0].shape[2], k[0].shape[3]
    int4 = kv_dtype == "int4"
    blocks = decode_config(DC, int4)
    t_blocks = triton.cdiv(T, blocks["BLOCK_T"])
    splits = splits or key_splits(B * Hq, t_blocks, _sm_count(q.device))
    chunk = triton.cdiv(max(t_blocks, 1), splits) * blocks["BLOCK_T"]
    splits = max(1, triton.cdiv(T, chunk))
    acc = torch.zeros(B, Hq, splits, 2 * DC, dtype=torch.float32, device=q.device)
    m = torch.full((B, Hq, splits), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros(B, Hq, splits, dtype=torch.float32, device=q.device)
    k_min, v_min = (k[2], v[2]) if int4 else (k[1], v[1])  # unread placeholders for int8
    mask = mask.to(torch.int8).expand(B, -1, 1, T)
    smh = mask.stride(1) if mask.shape[1] > 1 else 0
    if T:
        _quantized_decode[(B * Hq, splits)](
            q, k[0], k[1], k_min, v[0], v[1], v_min, mask, acc, m, l, Hq, T, DC, chunk, scale,
            q.stride(0), q.stride(1), q.stride(3), *k[0].stride(), *k[1].stride(), *k_min.stride(),
            *v[0].stride(), *v[1].stride(), *v_min.stride(), mask.stride(0), smh, mask.stride(3),
            GROUP=Hq // Hkv, GROUP_D=D // k[1].shape[-1], **blocks)
    _, weight, total = _split_weights(m, l)  # (B, Hq, splits), (B, Hq)
    total = total.unsqueeze(-1)
    out = (acc * weight.unsqueeze(-1)).sum(2) / torch.where(total > 0, total, torch.ones_like(total))
    return out[..., :D].unsqueeze(2).to(q.dtype)  # (B, Hq, 1, D); int8 leaves the upper half unused
