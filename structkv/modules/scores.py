"""Token scores beyond the window saliency of `structkv.ops.window_scores`: H2O's attention
received from every query, GemFilter's last-query logits, KeyDiff's key novelty and Expected
Attention's expected scores. Shapes: B batch, Hq/Hkv query/KV
heads, n current tokens, D head dim."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.decoder import apply_rope, rope_cos_sin, rotate_half
from ..ops import window_scores

H2O_QUERY_BLOCK = 1024


def received_attention(q, k, pos, scale: float, block: int = H2O_QUERY_BLOCK) -> torch.Tensor:
    """H2O's score: the attention each key receives from every prompt query, summed over the
    query heads of its KV group: (B, Hkv, n) from q (B, Hq, n, D), k (B, Hkv, n, D), pos (B, n).
    Queries go in blocks; columns are in position order, so block s..e-1 only reads keys < e
    (half the work of scoring every block against every key)."""
    n = k.shape[2]
    out = torch.zeros(k.shape[0], k.shape[1], n, device=k.device)
    for s in range(0, n, block):
        e = min(s + block, n)
        part = window_scores(q[:, :, s:e], k[:, :, :e], pos[:, s:e].contiguous(), pos[:, :e].contiguous(),
                             scale=scale)
        out[:, :, :e] += part * (e - s)  # window_scores averages over the block's queries
    return out


def ranked_columns(valid: torch.Tensor, window: int) -> torch.Tensor:
    """(B, n) the columns a selection ranks: valid and before the always-kept last `window`."""
    n = valid.shape[1]
    return valid & (torch.arange(n, device=valid.device) < n - window)


def share_of(x: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """x (B, H, n) as each column's share of its (B, H) sum over the ranked columns (B, n); zero
    elsewhere. Puts scores of different kinds on one scale before they are added."""
    x = x.float() * ranked[:, None]
    return x / x.sum(-1, keepdim=True).clamp_min(1e-30)


def percentile_of(x: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """x (B, H, n) as each ranked column's rank among its (B, H) row's ranked columns (B, n),
    scaled to (0, 1] (1 = the largest); zero elsewhere. Scores of different kinds on one scale
    whatever their spread."""
    x = x.float().masked_fill(~ranked[:, None], float("-inf"))
    rank = x.argsort(-1).argsort(-1).float() + 1  # (B, H, n): 1 = smallest
    below = (~ranked).sum(-1)[:, None, None]  # (B, 1, 1) columns sorted under every ranked one
    count = ranked.sum(-1)[:, None, None].clamp_min(1)
    return ((rank - below) / count).clamp_min(0) * ranked[:, None]


def percentile_union(a: torch.Tensor, b: torch.Tensor, share: float = 0.5) -> torch.Tensor:
    """Two signals' percentiles (`percentile_of`, 0 off the ranked columns) -> one score whose top
    K holds about `share` K of `a`'s top columns and the rest of `b`'s: each column's distance from
    the top, 1 - x, is stretched by 0.5 / its signal's share before the larger is taken (share 0.5:
    the plain larger percentile). Why: a column is kept when either signal ranks it high, and the
    budget splits between the signals as asked whatever their spreads."""
    if share != 0.5:
        a = (1 - (1 - a) * 0.5 / share).clamp_min(0) * (a > 0)
        b = (1 - (1 - b) * 0.5 / (1 - share)).clamp_min(0) * (b > 0)
    return torch.maximum(a, b)


def key_novelty(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff's score, query-free: 1 - cos(k_i, mean of the layer's normalised valid keys), per
    KV head: (B, Hkv, n) in [0, 2] from k (B, Hkv, n, D) and valid (B, n). A key unlike the
    others (a number, a name, an out-of-place sentence) scores high."""
    keys = F.normalize(k.float(), dim=-1)  # (B, Hkv, n, D)
    mask = valid[:, None, :, None]  # (B, 1, n, 1)
    anchor = (keys * mask).sum(2, keepdim=True) / mask.sum(2, keepdim=True).clamp_min(1)  # (B, Hkv, 1, D)
    return 1 - F.cosine_similarity(keys, anchor, dim=-1)


def last_query_logits(q, k, valid, kernel: int, reduce=None) -> torch.Tensor:
    """GemFilter's score: raw (unscaled, no softmax) last-query logits summed over heads,
    avg-pooled: (B, n). `reduce`: sums the partial sums of the heads held elsewhere (tensor
    parallelism), before pooling."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    q_last = q[:, :, -1].reshape(B, Hkv, Hq // Hkv, D).float()  # (B, Hkv, G, D)
    z = torch.einsum("bhgd,bhnd->bn", q_last, k.float())  # (B, n)
    if reduce is not None:
        z = reduce(z)
    z = torch.where(valid, z, torch.zeros_like(z))
    return F.avg_pool1d(z[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=True)[:, 0, : z.shape[1]]


def expected_attention(q, k, v, positions, inv_freq, scale: float, future: int, sinks: int, covariance: bool,
                       vnorm: bool) -> torch.Tensor:
    """Expected Attention's score (kvpress' ExpectedAttentionPress, written from its paper's
    formula): the attention each key can expect from queries not seen yet, (B, Hkv, n).

    The next queries are modelled per head as a Gaussian with the mean mu and covariance Sigma of
    the prompt's queries before RoPE (the first `sinks` tokens left out), turned by the mean RoPE
    rotation R of the next `future` positions. Then E[exp(q.k s)] = exp(s mu'.k + s^2 k'Sigma'k / 2)
    with mu' = R mu, Sigma' = R Sigma R^T; normalised over the keys (a softmax of those logits),
    times ||v|| with `vnorm`, summed over the query heads of each KV head. Shapes: q (B, Hq, n, D)
    after RoPE, k, v (B, Hkv, n, D), positions (B, n) (-1 padding), inv_freq (D/2,).
    """
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    valid = positions >= 0
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)  # (B, 1, n, D)
    q0 = apply_rope(q.float(), cos, -sin)  # (B, Hq, n, D): each token's rotation undone
    rank = valid.long().cumsum(1) - 1
    w = (valid & (rank >= sinks))[:, None, :, None].float()  # (B, 1, n, 1): tokens in the statistics
    count = w.sum(2).clamp_min(1.0)  # (B, 1, 1)
    mu = (q0 * w).sum(2) / count  # (B, Hq, D)
    ahead = positions.max(1).values[:, None] + 1 + torch.arange(future, device=q.device)  # (B, F)
    fc, fs = rope_cos_sin(inv_freq, ahead, torch.float32)  # (B, 1, F, D)
    c, s = fc.mean(2)[:, :, None], fs.mean(2)[:, :, None]  # (B, 1, 1, D): the mean rotation

    def rotate(x):  # R x over the last dim of x (B, Hq, m, D)
        return x * c + rotate_half(x) * s

    keys = k.float().repeat_interleave(G, dim=1)  # (B, Hq, n, D)
    logits = scale * torch.einsum("bhd,bhnd->bhn", rotate(mu[:, :, None])[:, :, 0], keys)  # (B, Hq, n)
    if covariance:
        centred = (q0 - mu[:, :, None]) * w  # (B, Hq, n, D)
        sigma = centred.transpose(-1, -2) @ centred / count[..., None]  # (B, Hq, D, D)
        sigma = rotate(rotate(sigma).transpose(-1, -2))  # R Sigma R^T
        logits = logits + 0.5 * scale**2 * torch.einsum("bhnd,bhde,bhne->bhn", keys, sigma, keys)
    probs = logits.masked_fill(~valid[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)  # (B, Hq, n)
    if vnorm:
        probs = probs * v.float().norm(dim=-1).repeat_interleave(G, dim=1)
    return probs.view(B, Hkv, G, n).sum(2)  # (B, Hkv, n)
