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
        self.register_buffer("cursor", torch.zeros(1, dtype=torch.long, device=device))  # next slot (full layers)

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
        self.cursor.fill_(S)

    def _fill_ring(self, k, v, positions) -> None:
        """Keep the entries within `window` positions of each row's last one, at slot pos % window.

        Works for any set of original positions (a token subset included): positions inside one
        window are distinct modulo the window, so no two kept entries share a slot.
        """
        B, H, S, D = k.shape
        W = self.capacity
        last = positions.max(dim=1, keepdim=True).values  # (B, 1)
        keep = (positions >= 0) & (positions > last - W)  # (B, S)
        slot = torch.where(keep, torch.remainder(positions, W), torch.full_like(positions, W))  # W: discarded
        slot = slot[:, None].expand(B, H, S)  # (B, Hkv, S)
        for buf, src in ((self.k, k), (self.v, v)):
            tmp = buf.new_zeros(B, H, W + 1, D)
            tmp.scatter_(2, slot[..., None].expand(B, H, S, D), src.to(buf.dtype))
            buf.copy_(tmp[:, :, :W])
        pos = positions.new_full((B, H, W + 1), -1)
        pos.scatter_(2, slot, torch.where(keep, positions, torch.full_like(positions, -1))[:, None].expand(B, H, S))
        self.pos.copy_(pos[:, :, :W])

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Append S new entries k, v (B, Hkv, S, D) with positions (B, S); compile-safe.

        Full layers write at the cursor (then advance it); ring layers at position % window.
        """
        B, H, S, D = k.shape
        if self.window is not None:
            if S > self.capacity:  # only the last `window` entries can ever be seen again
                k, v, positions = k[:, :, -self.capacity:], v[:, :, -self.capacity:], positions[:, -self.capacity:]
                S = self.capacity
            idx = torch.remainder(positions, self.capacity)[:, None, :]  # (B, 1, S)
        else:
            idx = (self.cursor + torch.arange(S, device=k.device)).view(1, 1, S).expand(B, 1, S)
            self.cursor.add_(S)
        idx = idx.expand(B, H, S)  # (B, Hkv, S)
        self.k.scatter_(2, idx[..., None].expand(B, H, S, D), k)
        self.v.scatter_(2, idx[..., None].expand(B, H, S, D), v)
        self.pos.scatter_(2, idx, positions[:, None].expand(B, H, S))

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
