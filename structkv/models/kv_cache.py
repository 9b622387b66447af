"""The KV caches: static, preallocated, one `LayerKVCache` per layer with the original position of
every slot.

The interface the decoder's decode step depends on (`KVCache`): `layers[i]` holds `k`, `v`
(B, Hkv, C, D), `pos` (B, Hkv, C) and `window`, and `write(k, v, positions)` appends in place.
Positions are stored per (batch row, KV head, slot) so that caches whose heads keep different
tokens (budgeted caches) use the same decode step: the mask comes from `pos`, -1 = empty slot.
Sliding-window layers keep a ring of exactly `window` slots (slot = position % window): a query
can never see further back, so the ring is exact and decode reads W entries, not the whole context.

- `StaticKVCache`: one capacity for every full-attention layer (uncompressed generation);
- `BudgetedKVCache`: a capacity per layer, filled at prefill from each layer's selected entries;
- `StackedKVCache`: the rows of several caches as one batch (one decode for many methods).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..ops import compact_kv

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
        """Bytes of K and V allocated."""
        return 2 * self.k.numel() * self.k.element_size()

    def entries(self) -> int:
        """Valid (non-empty) entries, summed over batch rows and KV heads."""
        return int((self.pos >= 0).sum())


class KVCache(nn.Module):
    """What every cache offers: `layers`, and accounting of what is kept and what is allocated."""

    layers: nn.ModuleList

    def forward(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """The cache behind one call: append k, v (B, Hkv, S, D) at positions (B, S) to layer
        `layer` and return its (k, v, pos) to attend over (pos (B, Hkv, C), -1 = empty)."""
        cache = self.layers[layer]
        cache.write(k, v, positions)
        return cache.k, cache.v, cache.pos

    def entries(self) -> list[int]:
        """Valid entries per layer, summed over batch rows and KV heads."""
        return [layer.entries() for layer in self.layers]

    def nbytes(self, used: bool = True) -> list[int]:
        """K+V bytes per layer: of the valid entries (used=True) or of the allocated buffers."""
        out = []
        for layer in self.layers:
            per_entry = 2 * layer.k.shape[-1] * layer.k.element_size()
            out.append(per_entry * (layer.entries() if used else layer.pos.numel()))
        return out

    def free(self) -> int:
        """Tokens that can still be appended to every row (rings never fill)."""
        return min((layer.capacity - int(layer.cursor) for layer in self.layers if layer.window is None),
                   default=1 << 30)

    def clone(self) -> "KVCache":
        """An independent copy (compress once, ask many: each question extends its own copy)."""
        return copy.deepcopy(self)


class StaticKVCache(KVCache):
    """One `LayerKVCache` per layer: `capacity` slots for full-attention layers, a window-sized ring
    for sliding-window layers."""

    def __init__(self, cfg, batch: int, capacity: int, dtype, device):
        super().__init__()
        self.layers = nn.ModuleList(
            LayerKVCache(batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device,
                         window=cfg.window(i) if cfg.window(i) is not None and cfg.window(i) < capacity else None)
            for i in range(cfg.num_layers)
        )


class BudgetedKVCache(KVCache):
    """A capacity per layer, filled at prefill from each layer's own selection (`compact_kv`) and
    appended to at decode at the layer's cursor; a sliding layer whose window is smaller than its
    capacity keeps its exact window as a ring. All shapes are static, so the compiled decode step
    compiles once, whatever the budgets.

    Args: batch B, num_kv_heads Hkv, head_dim D; capacities: slots per layer; rings: the window of
    each layer kept as a ring (None = a plain buffer). `for_model` sizes it from a model config.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, capacities: list[int],
                 rings: list[int | None], dtype, device):
        super().__init__()
        if len(capacities) != len(rings):
            raise ValueError(f"need one ring setting per layer: {len(capacities)} capacities, {len(rings)} rings")
        self.layers = nn.ModuleList(LayerKVCache(batch, num_kv_heads, capacity, head_dim, dtype, device, window=ring)
                                    for capacity, ring in zip(capacities, rings))

    @classmethod
    def for_model(cls, cfg, batch: int, budgets: list[int], room: int, dtype, device, num_kv_heads: int | None = None,
                  head_dim: int | None = None) -> "BudgetedKVCache":
        """`budgets`: entries kept at prefill per layer (max over rows); `room`: slots for tokens
        appended later (generated and question tokens). Capacities are rounded up like every cache; a
        sliding layer is a ring of its window when prompt and room would not fit the window. `cfg`:
        a `ModelConfig`, or a `Layout` of a decoder of your own (no sliding layers; give
        `num_kv_heads` and `head_dim`)."""
        if len(budgets) != cfg.num_layers:
            raise ValueError(f"need one budget per layer ({cfg.num_layers}), got {len(budgets)}")
        window = getattr(cfg, "window", lambda i: None)
        windows = [window(i) for i in range(cfg.num_layers)]
        rings = [w if w is not None and w < b + room else None for w, b in zip(windows, budgets)]
        return cls(batch, num_kv_heads or cfg.num_kv_heads, head_dim or cfg.head_dim,
                   [round_capacity(b + room) for b in budgets], rings, dtype, device)

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             indices: torch.Tensor | None, check: bool = True) -> None:
        """Store layer `layer`'s prompt entries: all of them (indices None, or a ring layer) or the
        selected ones, indices (B, Hkv, M) sorted with -1 left padding. `check`: validate the index
        lists (a host sync; callers that built them with `select_tokens` may skip it)."""
        cache = self.layers[layer]
        if indices is None or cache.window is not None:
            cache.fill(k, v, positions)
            return
        compact_kv(cache.k, cache.v, cache.pos, k, v, positions, pads_last(indices), check=check)
        cache.cursor.fill_(indices.shape[-1])


def pads_last(indices: torch.Tensor) -> torch.Tensor:
    """Move -1 entries from the front to the end (the layout `compact_kv` expects)."""
    big = torch.iinfo(torch.long).max
    moved = torch.where(indices < 0, torch.full_like(indices, big), indices).sort(-1).values
    return torch.where(moved == big, torch.full_like(moved, -1), moved)


class StackedKVCache(KVCache):
    """The rows of several caches of one model as one batch, so one decode step serves them all
    (e.g. every method's compressed prompt: the weights are read once per step, not once per method).

    Full-attention layers are padded to a common capacity (the largest cursor plus the smallest free
    room, rounded up like every cache) and written at the largest cursor: a row with fewer entries
    keeps empty slots (position -1, never attended to). Sliding layers become rings of the window
    when any row has one: a row whose layer is not a ring holds fewer than `window` positions, all
    of which fit the ring.
    """

    def __init__(self, caches: list):
        super().__init__()
        if not caches:
            raise ValueError("nothing to stack: give at least one cache")
        if len({len(c.layers) for c in caches}) != 1:
            raise ValueError("caches of different models (layer counts differ) cannot be stacked")
        self.layers = nn.ModuleList(_stack_layer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers)))
        self.rows = [c.layers[0].k.shape[0] for c in caches]


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
