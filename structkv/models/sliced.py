"""A layer run a few rows at a time, with a call between the slices: how a prefill makes way.

`Decoder.run(block=...)` runs each layer through a block function. `sliced_block(pause, rows)`
is one that computes the layer's q, k, v `rows` tokens at a time, then its attention, output
projection and MLP `rows` query tokens at a time, calling `pause()` after every slice. Why: in
`structkv serve` a long prompt's prefill runs while other requests decode; `pause` is where the
server runs their decode steps (`structkv.serve.interleave`), so a 4K prompt no longer stops
every stream for its whole prefill. Every method's prefill stays what it is (the same layers, the
same hooks between them, the same scores); only the order of the arithmetic inside a layer
changes, so the hidden states match the unsliced block up to float rounding.

Each slice's queries attend to the keys up to their own column, masked by original positions
(causal, sliding window, padding = -1) as everywhere in the decoder.
"""
from __future__ import annotations

import torch

from ..ops.attention import masked_attention

# Tokens per slice: Gemma 3 270M's 4K prefill pauses every ~8 ms at 64 on 2 cores (median; its
# layers' scoring between two slices is the longest stretch), against a ~50 ms decode step
ROWS = 64


def sliced_block(pause, rows: int = ROWS):
    """A `Decoder.run` block running a layer `rows` query tokens at a time, `pause()` between."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows per slice must be a positive int, got {rows!r}")

    def block(layer, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ordered=None):
        attn, S = layer.self_attn, h.shape[1]
        x, parts = layer.input_layernorm(h), []
        for s in range(0, S, rows):
            parts.append(attn.qkv(x[:, s:s + rows], cos[:, :, s:s + rows], sin[:, :, s:s + rows]))
            pause()
        q, k, v = (torch.cat(t, 2) for t in zip(*parts))  # (B, Hq, S, D), (B, Hkv, S, D) x 2
        out = torch.empty_like(h)  # (B, S, E)
        for s in range(0, S, rows):
            e = min(s + rows, S)
            a = _slice_attention(attn, q[:, :, s:e], k[:, :, :e], v[:, :, :e], positions[:, s:e], positions[:, :e])
            out[:, s:e] = layer.finish(h[:, s:e], a)
            pause()
        return out, q, k, v

    return block


def _slice_attention(attn, q, k, v, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Queries q (B, Hq, r, D) at q_pos (B, r) over keys k, v (B, Hkv, e, D) at k_pos (B, e):
    the output projection's input, (B, r, E)."""
    B, _, r, _ = q.shape
    seen = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # (B, r, e)
    if attn.sliding_window is not None:
        seen &= k_pos[:, None, :] > q_pos[:, :, None] - attn.sliding_window
    seen |= ~seen.any(-1, keepdim=True)  # a padding query sees every key: finite, never read
    out = masked_attention(q, k, v, seen[:, None], attn.scale)  # (B, Hq, r, D)
    return attn.o_proj(out.transpose(1, 2).reshape(B, r, -1))  # (B, r, Hq*D) -> (B, r, E)
