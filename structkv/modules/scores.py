"""Token scores beyond the window saliency of `structkv.ops.window_scores`: H2O's attention
received from every query and GemFilter's last-query logits. Shapes: B batch, Hq/Hkv query/KV
heads, n current tokens, D head dim."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
        part, _ = window_scores(q[:, :, s:e], k[:, :, :e], pos[:, s:e].contiguous(), pos[:, :e].contiguous(),
                                scale=scale)
        out[:, :, :e] += part * (e - s)  # window_scores averages over the block's queries
    return out


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
