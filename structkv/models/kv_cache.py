"""Static, preallocated KV cache: fixed capacity per layer plus the original position of every slot.

Positions are stored per (batch row, KV head, slot) so that caches whose heads keep different
tokens (budgeted caches) use the same decode step: the mask comes from `pos`, -1 = empty slot.
Sliding-window layers keep a ring of exactly `window` slots (slot = position % window): a query
can never see further back, so the ring is exact and decode reads W entries, not the whole context.
"""
from __future__ import annotations

import torch
from torch import nn

# Cache capacities are rounded up to a multiple of this, so prompts of similar length share one
# compiled decode graph (the extra slots stay empty, position -1, never attended to).
CAPACITY_MULTIPLE = 64


def round_capacity(slots: int) -> int:
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


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

        Full layers write at the cursor (then advance it); ring layers at position % window. Written
        with `index_put_`, which a compiled graph keeps in place (a compiled `scatter_` into a buffer
        copies the whole buffer every step).
        """
        B, H, S, D = k.shape
        if self.window is not None:
            if S > self.capacity:  # only the last `window` entries can ever be seen again
                k, v, positions = k[:, :, -self.capacity:], v[:, :, -self.capacity:], positions[:, -self.capacity:]
                S = self.capacity
            slot = torch.remainder(positions, self.capacity)  # (B, S)
        else:
            slot = (self.cursor + torch.arange(S, device=k.device)).view(1, S).expand(B, S)
            self.cursor.add_(S)
        rows = torch.arange(B, device=k.device).view(B, 1, 1)
        heads = torch.arange(H, device=k.device).view(1, H, 1)
        where = (rows, heads, slot[:, None, :])  # broadcast to (B, Hkv, S)
        self.k.index_put_(where, k.to(self.k.dtype))
        self.v.index_put_(where, v.to(self.v.dtype))
        self.pos.index_put_(where, positions[:, None, :].expand(B, H, S))

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


class StackedKVCache(nn.Module):
    """The rows of several caches of one model as one batch, so one decode step serves them all
    (e.g. every method's compressed prompt: the weights are read once per step, not once per method).

    Full-attention layers are padded to a common capacity (the largest cursor plus the smallest free
    room, rounded up like every cache) and written at the largest cursor: a row with fewer entries keeps empty slots (position -1,
    never attended to). Sliding layers become rings of the window when any row has one: a row whose
    layer is not a ring holds fewer than `window` positions, all of which fit the ring.
    """

    def __init__(self, caches: list):
        super().__init__()
        if not caches:
            raise ValueError("nothing to stack: give at least one cache")
        if len({len(c.layers) for c in caches}) != 1:
            raise ValueError("caches of different models (layer counts differ) cannot be stacked")
        self.layers = nn.ModuleList(_stack_layer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers)))
        self.rows = [c.layers[0].k.shape[0] for c in caches]

    def free(self) -> int:
        """Tokens that can still be appended to every row (rings never fill)."""
        return min((layer.capacity - int(layer.cursor) for layer in self.layers if layer.window is None),
                   default=1 << 30)


def _stack_layer(parts: list[LayerKVCache]) -> LayerKVCache:
    first = parts[0]
    _, H, _, D = first.k.shape
    if any(p.k.shape[1] != H or p.k.shape[3] != D or p.k.dtype != first.k.dtype for p in parts):
        raise ValueError("caches with different KV heads, head dims or dtypes cannot be stacked")
    batch = sum(p.k.shape[0] for p in parts)
    windows = {p.window for p in parts if p.window is not None}
    if len(windows) > 1:
        raise ValueError(f"sliding layers with different windows {sorted(windows)} cannot be stacked")
    if windows:
        out = LayerKVCache(batch, H, 0, D, first.k.dtype, first.k.device, window=windows.pop())
        row = 0
        for p in parts:
            b = p.k.shape[0]
            ring = LayerKVCache(b, H, 0, D, p.k.dtype, p.k.device, window=out.window)
            ring._fill_ring(p.k, p.v, p.pos[:, 0])  # sliding layers hold the same positions in every head
            for name in ("k", "v", "pos"):
                getattr(out, name)[row:row + b] = getattr(ring, name)
            row += b
        return out
    cursor = max(int(p.cursor) for p in parts)
    capacity = round_capacity(cursor + min(p.capacity - int(p.cursor) for p in parts))  # one decode graph per size
    out = LayerKVCache(batch, H, capacity, D, first.k.dtype, first.k.device)
    row = 0
    for p in parts:
        b, used = p.k.shape[0], int(p.cursor)
        out.k[row:row + b, :, :used] = p.k[:, :, :used]
        out.v[row:row + b, :, :used] = p.v[:, :, :used]
        out.pos[row:row + b, :, :used] = p.pos[:, :, :used]
        row += b
    out.cursor.fill_(cursor)
    return out
