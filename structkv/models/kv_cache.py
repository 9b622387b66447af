"""Static, preallocated KV cache: fixed capacity per layer plus the original position of every slot.

Positions are stored per (batch row, KV head, slot) so that caches whose heads keep different
tokens (budgeted caches) use the same decode step: the mask comes from `pos`, -1 = empty slot.
Sliding-window layers keep a ring of exactly `window` slots (slot = position % window): a query
can never see further back, so the ring is exact and decode reads W entries, not the whole context.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerKVCache(nn.Module):
    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 window: int | None = None):
        super().__init__()
        self.window = window  # ring buffer of `window` slots when set
        if window is not None:
            capacity = window
        self.register_buffer("k", torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, num_kv_heads, capacity), -1, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def fill(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a left-padded prompt's k, v (B, Hkv, S, D) with positions (B, S) (-1 = padding)."""
        B, H, S, D = k.shape
        if self.window is not None:
            return self._fill_ring(k, v, positions)
        if S > self.capacity:
            raise ValueError(f"{S} entries do not fit a cache of capacity {self.capacity}")
        self.k[:, :, :S] = k
        self.v[:, :, :S] = v
        self.pos[:, :, :S] = positions[:, None].expand(-1, H, -1)  # (B, Hkv, S)
        self.pos[:, :, S:] = -1

    def _fill_ring(self, k, v, positions) -> None:
        """Ring slot j holds the latest prompt position p with p % W == j (row-wise, left padding)."""
        B, H, S, D = k.shape
        W = self.capacity
        last = positions.max(dim=1, keepdim=True).values  # (B, 1) last position of each row
        slot = torch.arange(W, device=k.device)[None]  # (1, W)
        pos = last - torch.remainder(last - slot, W)  # (B, W), may be < 0 (empty)
        index = (S - 1 - last + pos).clamp_min(0)  # tensor column holding that position
        pos = torch.where(pos >= 0, pos, torch.full_like(pos, -1))
        gather = index[:, None, :, None].expand(B, H, W, D)  # (B, Hkv, W, D)
        self.k.copy_(k.gather(2, gather))
        self.v.copy_(v.gather(2, gather))
        self.pos.copy_(pos[:, None].expand(B, H, W))

    def write(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one step's k, v (B, Hkv, 1, D) with positions (B, 1); compile-safe.

        `slot` (1,) is the slot of full layers; ring layers use position % window per row.
        """
        B, H, _, D = k.shape
        if self.window is not None:
            idx = torch.remainder(positions, self.capacity)[:, None, :]  # (B, 1, 1)
        else:
            idx = slot.view(1, 1, 1).expand(B, 1, 1)
        idx = idx.expand(B, H, 1)  # (B, Hkv, 1)
        self.k.scatter_(2, idx[..., None].expand(B, H, 1, D), k)
        self.v.scatter_(2, idx[..., None].expand(B, H, 1, D), v)
        self.pos.scatter_(2, idx, positions[:, None].expand(B, H, 1))

    def nbytes(self) -> int:
        """Bytes of K and V."""
        return 2 * self.k.numel() * self.k.element_size()


class StaticKVCache(nn.Module):
    """One `LayerKVCache` per layer: `capacity` slots for full-attention layers, a window-sized ring
    for sliding-window layers."""

    def __init__(self, cfg, batch: int, capacity: int, dtype, device):
        super().__init__()
        self.layers = nn.ModuleList(
            LayerKVCache(batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device,
                         window=cfg.window(i) if cfg.window(i) is not None and cfg.window(i) < capacity else None)
            for i in range(cfg.num_layers)
        )

    @property
    def capacity(self) -> int:
        return max(layer.capacity for layer in self.layers)
