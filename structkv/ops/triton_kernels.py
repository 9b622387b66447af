"""Triton kernels behind `structkv::window_scores` and `structkv::compact_kv`.

Imported lazily (only on CUDA, or by tests under TRITON_INTERPRET=1), never at package import.
Kernel arguments: pointers, sizes, strides, then UPPERCASE constexprs. Everything is computed in
float32 (loads are upcast; the interpreter cannot do bf16 arithmetic), with masked tails.

window_scores is two passes, as in the CPU reference:
  1. `_window_stats`: per (batch, query head, block of window queries), stream over key blocks
     keeping the running max, sum of exp and sum of exp * logit -> logsumexp and entropy.
  2. `_window_saliency`: per (batch, KV head, block of keys), for each query head of the group,
     exp(logit - logsumexp) summed over the window -> saliency / w.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logits_tile(q, k, qp, kp, scale, sliding_window, softcap, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(BLOCK_W, BLOCK_N) float32 logits and visibility for a q tile and a k tile."""
    x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if HAS_SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # softcap * tanh(x / softcap)
    vis = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    if HAS_WINDOW:
        vis = vis & (qp[:, None] - kp[None, :] < sliding_window)
    return x, vis


@triton.jit
def _window_stats(Q, K, QPOS, KPOS, LSE, ENT,
                  Hq, W, N, D, scale, sliding_window, softcap,
                  sqb, sqh, sqw, sqd, skb, skh, skn, skd, sqpb, sqpw, skpb, skpn,
                  GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    pid = tl.program_id(0)
    b, h = pid // Hq, pid % Hq
    hk = h // GROUP
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    w_ok = offs_w < W
    q = tl.load(Q + b * sqb + h * sqh + offs_w[:, None] * sqw + offs_d[None, :] * sqd,
                mask=w_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    qp = tl.load(QPOS + b * sqpb + offs_w * sqpw, mask=w_ok, other=-1)
    m = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_W], tl.float32)
    e = tl.zeros([BLOCK_W], tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
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
    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    lse = m + tl.log(l_safe)
    out = pid * W + offs_w  # LSE and ENT are contiguous (B, Hq, W)
    tl.store(LSE + out, tl.where(seen, lse, float("inf")), mask=w_ok)  # +inf: row contributes nothing
    if WITH_ENTROPY:
        tl.store(ENT + out, tl.where(seen, tl.maximum(lse - e / l_safe, 0.0), 0.0), mask=w_ok)


@triton.jit
def _window_saliency(Q, K, QPOS, KPOS, LSE, SAL,
                     Hq, Hkv, W, N, D, scale, sliding_window, softcap,
                     sqb, sqh, sqw, sqd, skb, skh, skn, skd, sqpb, sqpw, skpb, skpn,
                     GROUP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    pid = tl.program_id(0)
    b, hk = pid // Hkv, pid % Hkv
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    kp = tl.load(KPOS + b * skpb + offs_n * skpn, mask=n_ok, other=-1)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            w_ok = offs_w < W
            q = tl.load(Q + b * sqb + h * sqh + offs_w[:, None] * sqw + offs_d[None, :] * sqd,
                        mask=w_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            qp = tl.load(QPOS + b * sqpb + offs_w * sqpw, mask=w_ok, other=-1)
            lse = tl.load(LSE + (b * Hq + h) * W + offs_w, mask=w_ok, other=float("inf"))
            x, vis = _logits_tile(q, k, qp, kp, scale, sliding_window, softcap, HAS_WINDOW, HAS_SOFTCAP)
            p = tl.where(vis, tl.exp(x - lse[:, None]), 0.0)
            acc += tl.sum(p, 0)
    tl.store(SAL + pid * N + offs_n, acc / W, mask=n_ok)


def _blocks(w: int, d: int):
    block_d = max(16, triton.next_power_of_2(d))
    block_w = min(64, max(16, triton.next_power_of_2(w)))
    block_n = 64 if block_d <= 128 else 32
    return block_w, block_n, block_d


def window_scores_triton(q, k, q_pos, k_pos, scale: float, sliding_window: int, softcap: float, entropy: bool = True):
    """Launch both passes. q (B, Hq, w, D), k (B, Hkv, N, D), q_pos (B, w), k_pos (B, N) int64.

    Returns saliency (B, Hkv, N) and entropy (B, Hq, w) (B, Hq, 0) unless `entropy`), float32;
    any strides are accepted. Without `entropy` the first pass skips its third accumulator.
    """
    B, Hq, W, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0 and k.shape[0] == B and k.shape[3] == D
    assert q_pos.shape == (B, W) and k_pos.shape == (B, N)
    lse = torch.empty((B, Hq, W), dtype=torch.float32, device=q.device)
    ent = torch.empty((B, Hq, W if entropy else 0), dtype=torch.float32, device=q.device)
    sal = torch.empty((B, Hkv, N), dtype=torch.float32, device=q.device)
    if B * Hq * W == 0 or N == 0:
        return sal.zero_(), ent.zero_()
    block_w, block_n, block_d = _blocks(W, D)
    strides = (*q.stride(), *k.stride(), *q_pos.stride(), *k_pos.stride())
    flags = dict(GROUP=Hq // Hkv, BLOCK_W=block_w, BLOCK_N=block_n, BLOCK_D=block_d,
                 HAS_WINDOW=sliding_window > 0, HAS_SOFTCAP=softcap > 0, WITH_ENTROPY=entropy)
    _window_stats[(B * Hq, triton.cdiv(W, block_w))](
        q, k, q_pos, k_pos, lse, ent, Hq, W, N, D, scale, sliding_window, softcap, *strides, **flags)
    _window_saliency[(B * Hkv, triton.cdiv(N, block_n))](
        q, k, q_pos, k_pos, lse, sal, Hq, Hkv, W, N, D, scale, sliding_window, softcap, *strides, **flags)
    return sal, ent


@triton.jit
def _compact(K, V, KPOS, IDX, KC, VC, PC,
             Hkv, M, D,
             skb, skh, skn, skd, svb, svh, svn, svd, skpb, skpn, sib, sih, sim,
             scb, sch, scc, scd, svcb, svch, svcc, svcd, spb, sph, spc,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
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


def compact_kv_triton(k_cache, v_cache, pos_cache, k, v, k_pos, indices) -> None:
    """Gather kernel for `structkv::compact_kv` (same contract as the reference)."""
    B, H, N, D = k.shape
    M = indices.shape[2]
    if B * H * M:
        block_d = max(16, triton.next_power_of_2(D))
        block_m = 32
        _compact[(B * H, triton.cdiv(M, block_m))](
            k, v, k_pos, indices, k_cache, v_cache, pos_cache, H, M, D,
            *k.stride(), *v.stride(), *k_pos.stride(), *indices.stride(),
            *k_cache.stride(), *v_cache.stride(), *pos_cache.stride(), BLOCK_M=block_m, BLOCK_D=block_d)
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
def _quantized_decode(Q, KC, KS, KM, VC, VS, VM, MASK, OUT,
                      Hq, T, DC, scale,
                      sqb, sqh, sqd, skb, skh, skt, skd, sksb, sksh, skst, sksg, skmb, skmh, skmt, skmg,
                      svb, svh, svt, svd, svsb, svsh, svst, svsg, svmb, svmh, svmt, svmg,
                      smb, smh, smt, sob, soh, sod,
                      GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INT4: tl.constexpr,
                      GROUP_D: tl.constexpr):
    """One program per (batch row, query head): stream over the cache's tiles with an online
    softmax, dequantizing each tile in registers."""
    pid = tl.program_id(0)
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
    for start in range(0, T, BLOCK_T):
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
    inv = tl.where(l > 0, 1.0 / l, 0.0)
    out = OUT + b * sob + h * soh
    tl.store(out + offs_d * sod, (acc_lo * inv).to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(out + (offs_d + DC) * sod, (acc_hi * inv).to(OUT.dtype.element_ty), mask=d_ok & INT4)


def quantized_decode_attention_triton(q, k, v, mask, scale: float, kv_dtype: str) -> torch.Tensor:
    """Kernel for `structkv::quantized_decode_attention` (same contract as the reference)."""
    B, Hq, _, D = q.shape
    Hkv, T, DC = k[0].shape[1], k[0].shape[2], k[0].shape[3]
    int4 = kv_dtype == "int4"
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    k_min, v_min = (k[2], v[2]) if int4 else (k[1], v[1])  # unread placeholders for int8
    mask = mask.to(torch.int8).expand(B, -1, 1, T)
    smh = mask.stride(1) if mask.shape[1] > 1 else 0
    _quantized_decode[(B * Hq,)](
        q, k[0], k[1], k_min, v[0], v[1], v_min, mask, out, Hq, T, DC, scale,
        q.stride(0), q.stride(1), q.stride(3), *k[0].stride(), *k[1].stride(), *k_min.stride(),
        *v[0].stride(), *v[1].stride(), *v_min.stride(), mask.stride(0), smh, mask.stride(3),
        out.stride(0), out.stride(1), out.stride(3),
        GROUP=Hq // Hkv, BLOCK_T=32, BLOCK_D=max(16, triton.next_power_of_2(DC)), INT4=int4,
        GROUP_D=D // k[1].shape[-1])
    return out
