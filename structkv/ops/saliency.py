"""`structkv::window_scores`: how much attention the observation window pays to every key.

Every scoring method (SnapKV, FastKV, GemFilter, StructKV) needs, per layer, the softmax attention
of the last w prompt queries over all N keys, summed over the query heads of each KV group and
averaged over the window. Materialising (B, Hq, w, N) probabilities is what makes long prompts
expensive, so both implementations stream over keys:

- CPU reference: plain aten ops in chunks of keys, two passes (online max / sum-exp / expected
  logit, then normalised column sums). Extra memory is O(B*Hq*w*CHUNK), never O(N) per query.
- CUDA: two Triton kernels with the same passes (`structkv.ops.triton_kernels`).

Registration: a `torch.library.custom_op` with a fake kernel, opaque to the compiler. (A
`triton_op` body is traced by Inductor, and the chunk loop then specialises on N: one recompile
per prompt length. As an opaque op, one compile serves every N.)

Notation: B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, w window queries, N keys, D head dim.
Visibility: query i sees key j iff k_pos[j] >= 0 (valid), k_pos[j] <= q_pos[i], and, with a sliding
window W, q_pos[i] - k_pos[j] < W. Padding and empty slots have position -1.
"""
from __future__ import annotations

import math

import torch

CHUNK = 1024  # keys per chunk in the CPU reference


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """(B, 1, 1, w, n) bool from q_pos (B, w) and k_pos (B, n); window <= 0 means none."""
    q = q_pos[:, None, None, :, None]
    k = k_pos[:, None, None, None, :]
    vis = (k >= 0) & (k <= q)
    if sliding_window > 0:
        vis = vis & (q - k < sliding_window)
    return vis


def _logits(qg: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """qg (B, Hkv, G, w, D) x k (B, Hkv, n, D) -> (B, Hkv, G, w, n) float32 logits."""
    x = torch.matmul(qg, k[:, :, None].transpose(-1, -2).float()) * scale
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    return x


def window_scores_reference(q, k, q_pos, k_pos, scale: float, sliding_window: int = 0, softcap: float = 0.0,
                            chunk: int = CHUNK, entropy: bool = True):
    """Chunked two-pass reference; see the module docstring. Returns (saliency, entropy) float32,
    entropy (B, Hq, 0) unless asked for (its accumulator is then skipped)."""
    B, Hq, w, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, w, D)  # (B, Hkv, G, w, D)
    m = torch.full((B, Hkv, G, w), float("-inf"), device=q.device)
    l = torch.zeros(B, Hkv, G, w, device=q.device)
    e = torch.zeros(B, Hkv, G, w, device=q.device)
    for s in range(0, N, chunk):  # pass 1: online max, sum of exp, sum of exp * logit
        x = _logits(qg, k[:, :, s:s + chunk], scale, softcap)  # (B, Hkv, G, w, c)
        hidden = ~_visible(q_pos, k_pos[:, s:s + chunk], sliding_window)
        x.masked_fill_(hidden, float("-inf"))
        m_new = torch.maximum(m, x.amax(-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        alpha = torch.where(torch.isfinite(m), torch.exp(m - m_safe), 0.0)
        if entropy:
            e.mul_(alpha).add_(torch.nan_to_num(x, neginf=0.0).mul_(torch.exp(x - m_safe[..., None])).sum(-1))
        l.mul_(alpha).add_(x.sub_(m_safe[..., None]).exp_().sum(-1))
        m = m_new
    seen = l > 0
    l_safe = torch.where(seen, l, 1.0)
    lse = torch.where(seen, m + torch.log(l_safe), float("inf"))  # +inf: an unseen row contributes 0
    ent = torch.where(seen, lse - e / l_safe, 0.0).reshape(B, Hq, w).clamp_min(0.0) if entropy else q.new_zeros(
        (B, Hq, 0), dtype=torch.float32)
    saliency = torch.zeros(B, Hkv, N, device=q.device)
    for s in range(0, N, chunk):  # pass 2: normalised probabilities, summed over group and window
        x = _logits(qg, k[:, :, s:s + chunk], scale, softcap)
        x.masked_fill_(~_visible(q_pos, k_pos[:, s:s + chunk], sliding_window), float("-inf"))
        saliency[:, :, s:s + chunk] = x.sub_(lse[..., None]).exp_().sum(dim=(2, 3)).div_(w)
    return saliency, ent


def window_scores_naive(q, k, q_pos, k_pos, scale: float, sliding_window: int = 0, softcap: float = 0.0):
    """Materialises the full (B, Hq, w, N) softmax: the definition, for tests and benchmarks."""
    B, Hq, w, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    x = _logits(q.float().reshape(B, Hkv, G, w, D), k, scale, softcap)
    vis = _visible(q_pos, k_pos, sliding_window)
    x = torch.where(vis, x, torch.tensor(float("-inf")))
    p = torch.nan_to_num(torch.softmax(x, -1), nan=0.0)  # rows with no visible key -> 0
    logp = torch.where(p > 0, torch.log(p), torch.zeros_like(p))
    entropy = -(p * logp).sum(-1).reshape(B, Hq, w)
    return p.sum(dim=(2, 3)) / w, entropy


@torch.library.custom_op("structkv::window_scores", mutates_args=(), device_types=None)
def _window_scores_op(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                      sliding_window: int, softcap: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        from .triton_kernels import window_scores_triton

        return window_scores_triton(q, k, q_pos, k_pos, scale, sliding_window, softcap, entropy)
    return window_scores_reference(q, k, q_pos, k_pos, scale, sliding_window, softcap, entropy=entropy)


@_window_scores_op.register_fake
def _(q, k, q_pos, k_pos, scale, sliding_window, softcap, entropy):
    B, Hq, w, _ = q.shape
    return (q.new_empty((B, k.shape[1], k.shape[2]), dtype=torch.float32),
            q.new_empty((B, Hq, w if entropy else 0), dtype=torch.float32))


def _check(q, k, q_pos, k_pos, sliding_window, softcap):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q must be (B, Hq, w, D) and k (B, Hkv, N, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, w, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hq % k.shape[1]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({k.shape[1]})")
    if tuple(q_pos.shape) != (B, w) or tuple(k_pos.shape) != (B, k.shape[2]):
        raise ValueError(f"q_pos must be (B, w) = {(B, w)} and k_pos (B, N) = {(B, k.shape[2])}; "
                         f"got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
    if not q.dtype.is_floating_point or not k.dtype.is_floating_point:
        raise ValueError(f"q and k must be floating point, got {q.dtype} and {k.dtype}")
    if q_pos.dtype.is_floating_point or k_pos.dtype.is_floating_point:
        raise ValueError(f"positions must be integer tensors, got {q_pos.dtype} and {k_pos.dtype}")
    if len({q.device, k.device, q_pos.device, k_pos.device}) != 1:
        raise ValueError("q, k, q_pos and k_pos must be on one device")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding window must be a positive int or None, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")


def window_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                  scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                  entropy: bool = False):
    """Window-attention saliency per KV head (and, when asked, the entropy per window query).

    Args:
        q: (B, Hq, w, D) window queries, RoPE applied.
        k: (B, Hkv, N, D) keys, RoPE applied; Hq must be a multiple of Hkv.
        q_pos: (B, w) original positions of the window queries.
        k_pos: (B, N) original positions of the keys; -1 marks padding / invalid keys.
        scale: softmax scale (default 1/sqrt(D)). window: sliding window or None. softcap: logit
            soft-capping (x -> c*tanh(x/c)) or None.
        entropy: also return each window query's entropy (no method needs it; the detector's
            statistics are over the pooled saliency), so it is only computed when asked for.
    Returns saliency, or (saliency, entropy) with `entropy=True`:
        saliency (B, Hkv, N) float32: for each KV head, the sum over its G query heads of the mean
            over the w queries of the attention probability on each key (0 where invisible); each
            query row with a visible key contributes mass 1, so a KV head's row sums to <= G.
        entropy (B, Hq, w) float32: natural-log entropy of each query's attention distribution.
    """
    _check(q, k, q_pos, k_pos, sliding_window, softcap)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sal, ent = _window_scores_op(q, k, q_pos.long(), k_pos.long(), scale, int(sliding_window or 0),
                                 float(softcap or 0.0), bool(entropy))
    return (sal, ent) if entropy else sal
