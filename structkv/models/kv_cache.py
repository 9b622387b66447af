"""Static, preallocated KV cache: fixed capacity per layer plus the original position of every slot.

Positions are stored per (batch row, KV head, slot) so that caches whose heads keep different
tokens (budgeted caches) use the same decode step: the mask comes from `pos`, -1 = empty slot.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerKVCache(nn.Module):
    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device))
        self.register_buffer("pos", torch.full((batch, num_kv_heads, capacity), -1, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def fill(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a prompt's k, v (B, Hkv, S, D) with their positions (B, S) or (B, Hkv, S) in slots [0, S)."""
        S = k.shape[2]
        if S > self.capacity:
            raise ValueError(f"{S} entries do not fit a cache of capacity {self.capacity}")
        if positions.dim() == 2:
            positions = positions[:, None].expand(-1, self.k.shape[1], -1)  # (B, Hkv, S)
        self.k[:, :, :S] = k
        self.v[:, :, :S] = v
        self.pos[:, :, :S] = positions
        self.pos[:, :, S:] = -1

    def write(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one step's k, v (B, Hkv, 1, D) at `slot` (1,) with positions (B, 1); compile-safe."""
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.pos.index_copy_(2, slot, positions[:, None].expand(-1, self.k.shape[1], -1))  # (B, Hkv, 1)

    def nbytes(self, used: int | None = None) -> int:
        """Bytes of K and V (all slots, or the first `used`)."""
        slots = self.capacity if used is None else used
        per_slot = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return 2 * slots * per_slot


class StaticKVCache(nn.Module):
    """One `LayerKVCache` per layer, all of the same capacity."""

    def __init__(self, cfg, batch: int, capacity: int, dtype, device):
        super().__init__()
        self.layers = nn.ModuleList(
            LayerKVCache(batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device) for _ in range(cfg.num_layers)
        )

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity
