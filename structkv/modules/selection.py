"""Top-k token selection shared by every method: budgets, the forced observation window, ties.

Conventions (used by all modules):
- token lists are per batch row over the *current* columns (B, n); padding columns sit on the
  left (position -1), the observation window is the last `window` columns;
- a selection is a sorted index tensor (B, H, K), K = max budget over rows; rows that keep fewer
  tokens are padded with -1 on the left, so gathered rows stay left-padded;
- ties are broken towards the earlier token (stable sort), so results are deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .budget import Budget


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str | None) -> torch.Tensor:
    """1-D max or average pooling over tokens with 'same' padding: (B, H, n) -> (B, H, n)."""
    if pooling is None or kernel <= 1 or scores.shape[-1] == 0:
        return scores
    B, H, n = scores.shape
    x = scores.reshape(B * H, 1, n)  # (B*H, 1, n)
    if pooling == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    else:
        raise ValueError(f"unknown pooling {pooling!r}: use 'max', 'avg' or None")
    return x[..., :n].reshape(B, H, n)


def pooled_saliency(saliency: torch.Tensor, window: int, kernel: int, pooling: str | None) -> torch.Tensor:
    """Window saliency (B, H, n) pooled over the non-window tokens; the window's own columns are 0,
    since the window is always kept and never ranked."""
    n = saliency.shape[-1]
    out = torch.zeros_like(saliency)
    out[:, :, : n - window] = pool_scores(saliency[:, :, : n - window], kernel, pooling)
    return out


def budget_tokens(budget: float | int, lengths: torch.Tensor, what: str = "budget") -> list[int]:
    """Tokens to keep per row for a budget (`Budget`: a ratio in (0, 1] or a token count)."""
    return Budget.parse(budget, what).tokens(lengths)


def kept_counts(keep: list[int], lengths: list[int]) -> list[int]:
    """Tokens a selection keeps per row: its budget, or the whole row when shorter."""
    return [min(k, n) for k, n in zip(keep, lengths)]


def select_tokens(scores: torch.Tensor, valid: torch.Tensor, keep: list[int], window: int,
                  lengths: list[int] | None = None) -> torch.Tensor:
    """Keep, per row and head, the last `window` valid tokens plus the best-scored others.

    scores: (B, H, n) (higher is better); valid: (B, n) bool; keep: tokens to keep per row
    (window included; >= the row length keeps everything); lengths: the rows' valid tokens when
    the caller knows them (the prefill loop does), else read from `valid` (a host sync). Returns
    sorted (B, H, K) int64 indices with -1 left padding, K = max(kept_counts(keep, lengths)).
    """
    B, H, n = scores.shape
    lens = valid.sum(1).tolist() if lengths is None else lengths
    keep = kept_counts(keep, lens)
    K = max(keep)
    col = torch.arange(n, device=scores.device)
    in_window = col[None] >= n - window  # (1, n): the last `window` columns
    candidates = valid & ~in_window  # (B, n)
    masked = torch.where(candidates[:, None], scores.float(), torch.tensor(float("-inf"), device=scores.device))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # (B, H, n)
    n_best = [max(k - min(window, l), 0) for k, l in zip(keep, lens)]  # per row, outside the window
    out = torch.full((B, H, K), -1, dtype=torch.long, device=scores.device)
    for b in range(B):
        best = order[b, :, : n_best[b]]  # (H, n_best)
        win = col[(n - min(window, lens[b])):].expand(H, -1)  # (H, w)
        chosen = torch.cat([best, win], dim=-1).sort(-1).values  # (H, keep_b)
        out[b, :, K - chosen.shape[-1]:] = chosen
    return out


def gather_tokens(x: torch.Tensor, indices: torch.Tensor, fill=0) -> torch.Tensor:
    """Gather columns of x (B, n, ...) at indices (B, K) with -1 -> `fill`."""
    idx = indices.clamp_min(0)
    shape = idx.shape + x.shape[2:]
    out = x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(shape))
    pad = (indices < 0).view(*idx.shape, *([1] * (x.dim() - 2)))
    return torch.where(pad, torch.as_tensor(fill, dtype=x.dtype, device=x.device), out)
