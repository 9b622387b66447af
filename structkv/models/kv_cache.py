"""The KV caches: static, preallocated, one `LayerKVCache` per layer with the original position of
every slot.

The interface the decoder's decode step depends on (`KVCache`): `layers[i]` holds `pos` (B, Hkv,
C) and `window`, `write(k, v, positions)` appends in place, `attend(q, mask, scale)` is one
token's attention over the entries and `read()` gives them as floats (B, Hkv, C, D). The entries
themselves are float planes `k`, `v`, or with `kv_dtype` "int8" / "int4" their codes and scale
tables (`structkv.ops.kv_quant`), quantized once on the way in, so every method's eviction
stacks with quantization.
Positions are stored per (batch row, KV head, slot) so that caches whose heads keep different
tokens (budgeted caches) use the same decode step: the mask comes from `pos`, -1 = empty slot.
Sliding-window layers keep a ring of exactly `window` slots (slot = position % window): a query
can never see further back, so the ring is exact and decode reads W entries, not the whole context.

- `StaticKVCache`: one capacity for every full-attention layer (uncompressed generation);
- `BudgetedKVCache` (`structkv.modules.budgeted_cache`): a capacity per layer, filled at prefill
  from each layer's selected entries;
- `StackedKVCache`: the rows of several caches as one batch (one decode for many methods).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..ops import cpu_decode
from ..ops.kv_quant import (
    TABLE_DTYPES,
    TABLES,
    check_kv_dtype,
    code_dtype,
    code_width,
    dequantize_kv,
    quantize_kv,
    table_width,
)
from .kv_attention import AttentionDispatch
from .kv_decode_memory import DecodeMemory

# Cache capacities are rounded up to a multiple of this, so prompts of similar length share one
# compiled decode graph (the extra slots stay empty, position -1, never attended to).
CAPACITY_MULTIPLE = 64


def round_capacity(slots: int) -> int:
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


class LayerKVCache(AttentionDispatch, DecodeMemory, nn.Module):
    """One layer's entries: planes k, v (B, Hkv, C, D) in a float dtype, or, with `kv_dtype`
    "int8" / "int4", their codes and per-entry scale tables (`structkv.ops.kv_quant`: k and v hold
    the codes, k_scale / v_scale (and k_min / v_min) are (B, Hkv, C, 1 or D/32)); pos (B, Hkv, C) the
    original position of every slot (-1 empty). Every write quantizes once, on the way in.

    This class is the storage and its layouts (planes, rings, compaction, rows); how a query reads
    the entries is `AttentionDispatch` (`kv_attention.py`), and what a decode-time KV bound keeps
    beside them is `DecodeMemory` (`kv_decode_memory.py`)."""

    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 sliding_window: int | None = None, kv_dtype: str | None = None):
        super().__init__()
        check_kv_dtype(kv_dtype)
        self.sliding_window = sliding_window  # ring buffer of `window` slots when set
        self.kv_dtype, self.head_dim = kv_dtype, head_dim
        if sliding_window is not None:
            capacity = sliding_window
        shape = (batch, num_kv_heads, capacity)
        for name, (last, plane_dtype) in self._plane_specs(head_dim, dtype).items():
            self.register_buffer(name, torch.zeros(*shape, last, dtype=plane_dtype, device=device))
        self.register_buffer("pos", torch.full(shape, -1, dtype=torch.long, device=device))
        self.register_buffer("cursor", torch.zeros(1, dtype=torch.long, device=device))  # next slot (full layers)
        # CPU threads a decode attention may split its keys over (`decode_splits`), read when the
        # cache is made: a plain attribute, so a compiled decode step sees a constant
        self.threads = torch.get_num_threads() if self.pos.device.type == "cpu" else 1
        # the CPU decode kernel (built on first use; False: PyTorch's SDPA), asked here, outside
        # any compiled step, so the step sees a constant
        self.kernel = self.pos.device.type == "cpu" and cpu_decode.available()
        self.query_slots = 0  # > 0: the last decode queries are kept (`keep_queries`, a decode-time KV bound)
        # a decode bound's "centrality" rule: a score per position (B, P) and the last query position
        # folded into it (B,), -1 none (`carry_centrality`)
        self.register_buffer("carried", None, persistent=False)
        self.register_buffer("carried_upto", None, persistent=False)

    def _plane_specs(self, head_dim: int, dtype) -> dict:
        """name -> (last dimension, dtype) of every plane, k's then v's."""
        if self.kv_dtype is None:
            return {"k": (head_dim, dtype), "v": (head_dim, dtype)}
        codes = (code_width(self.kv_dtype, head_dim), code_dtype(self.kv_dtype))
        tables = {t: (table_width(self.kv_dtype, head_dim), TABLE_DTYPES[t]) for t in TABLES[self.kv_dtype]}
        return {f"{side}{suffix}": spec for side in ("k", "v") for suffix, spec in (("", codes), *tables.items())}

    @staticmethod
    def capacity_buffers() -> tuple[str, ...]:
        """Every buffer whose dim 2 is the capacity C, over every entry kind: each plane and `pos`
        (what serve's compiled batch step marks dynamic: `structkv.runtime.decoding`)."""
        kinds = [("k", "v")] + [tuple(f"{side}{suffix}" for side in ("k", "v") for suffix in ("", *tables))
                                for tables in TABLES.values()]
        return tuple(dict.fromkeys([name for planes in kinds for name in planes] + ["pos"]))

    @property
    def planes(self) -> tuple[str, ...]:
        """Names of the entry planes, k's then v's (each (B, Hkv, C, last))."""
        return ("k", "v") if self.kv_dtype is None else tuple(
            f"{side}{suffix}" for side in ("k", "v") for suffix in ("", *TABLES[self.kv_dtype]))

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """k, v (B, Hkv, S, D) -> one tensor per plane, in `planes` order (quantized when asked)."""
        if self.kv_dtype is None:
            return k.to(self.k.dtype), v.to(self.v.dtype)
        return (*quantize_kv(k, self.kv_dtype), *quantize_kv(v, self.kv_dtype))

    def read(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, C, D) as floats (`dtype`, default the float planes' own or float32):
        the buffers themselves when not quantized, else a dequantized copy."""
        if self.kv_dtype is None:
            return self.k, self.v
        return tuple(dequantize_kv(side, self.kv_dtype, dtype or torch.float32) for side in self._sides())

    def compact(self) -> None:
        """Move each (row, head)'s entries to the front of a full-attention layer, in their order,
        empty slots after them; the cursor becomes the most entries any of them holds (attention
        reads positions, not slot order, so nothing it computes changes). Rings stay as they are."""
        if self.sliding_window is not None:
            return
        order = (self.pos < 0).to(torch.int8).argsort(dim=-1, stable=True)  # (B, Hkv, C): entries first
        for name in self.planes:
            x = getattr(self, name)
            x.copy_(x.gather(2, order[..., None].expand_as(x)))
        self.pos.copy_(self.pos.gather(-1, order))
        self.cursor.fill_(int((self.pos >= 0).sum(-1).max()) if self.pos.numel() else 0)

    def resized(self, capacity: int) -> "LayerKVCache":
        """A compacted copy of a full-attention layer with `capacity` slots (it must hold the entries)."""
        self.compact()
        used = int(self.cursor)
        if used > capacity:
            raise ValueError(f"{used} entries per head do not fit {capacity} slots")
        out = LayerKVCache(self.pos.shape[0], self.pos.shape[1], capacity, self.head_dim, self.k.dtype,
                           self.pos.device, kv_dtype=self.kv_dtype)
        for name in (*self.planes, "pos"):
            getattr(out, name)[:, :, :used] = getattr(self, name)[:, :, :used]
        out.cursor.fill_(used)
        return out

    def append_entries(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append entries with their own position per head, k, v (B, Hkv, K, D), pos (B, Hkv, K)
        (-1: an empty slot), at the cursor of a full-attention layer (recalled entries)."""
        B, H, K, _ = k.shape
        if self.sliding_window is not None:
            raise ValueError("entries are appended per head only to full-attention layers, not to a ring")
        if int(self.cursor) + K > self.capacity:
            raise ValueError(f"{K} entries do not fit the {self.capacity - int(self.cursor)} free slots")
        slots = slice(int(self.cursor), int(self.cursor) + K)
        for name, src in zip(self.planes, self.encode(k, v)):
            getattr(self, name)[:, :, slots] = src
        self.pos[:, :, slots] = pos
        self.cursor.add_(K)

    def grown(self, extra: int) -> "LayerKVCache":
        """A copy with `extra` more free slots (a ring is copied as it is)."""
        if self.sliding_window is not None:
            return copy.deepcopy(self)
        used = int(self.cursor)
        out = LayerKVCache(self.pos.shape[0], self.pos.shape[1], round_capacity(self.capacity + extra), self.head_dim,
                           self.k.dtype, self.pos.device, kv_dtype=self.kv_dtype)
        for name in (*self.planes, "pos"):
            getattr(out, name)[:, :, :used] = getattr(self, name)[:, :, :used]
        out.cursor.copy_(self.cursor)
        return out

    def _sides(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The planes of k and of v (codes, then their tables)."""
        planes = [getattr(self, name) for name in self.planes]
        return planes[:len(planes) // 2], planes[len(planes) // 2:]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def fill(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a left-padded prompt's k, v (B, Hkv, S, D) with positions (B, S) (-1 = padding)."""
        self.fill_planes(self.encode(k, v), positions)

    def fill_planes(self, planes: tuple[torch.Tensor, ...], positions: torch.Tensor) -> None:
        """`fill` with already encoded planes (one per `planes` name, (B, Hkv, S, last))."""
        B, H, S = planes[0].shape[:3]
        if self.sliding_window is not None:
            return self._fill_ring(planes, positions)
        if S > self.capacity:
            raise ValueError(f"{S} entries do not fit a cache of capacity {self.capacity}")
        for name, src in zip(self.planes, planes):
            getattr(self, name)[:, :, :S] = src
        self.pos[:, :, :S] = positions[:, None].expand(-1, H, -1)  # (B, Hkv, S)
        self.pos[:, :, S:] = -1
        self.cursor.fill_(S)

    def _fill_ring(self, planes, positions) -> None:
        """Keep the entries within `window` positions of each row's last one, at slot pos % window.

        Works for any set of original positions (a token subset included): positions inside one
        window are distinct modulo the window, so no two kept entries share a slot.
        """
        B, H, S = planes[0].shape[:3]
        W = self.capacity
        last = positions.max(dim=1, keepdim=True).values  # (B, 1)
        keep = (positions >= 0) & (positions > last - W)  # (B, S)
        slot = torch.where(keep, torch.remainder(positions, W), torch.full_like(positions, W))  # W: discarded
        slot = slot[:, None].expand(B, H, S)  # (B, Hkv, S)
        for name, src in zip(self.planes, planes):
            buf = getattr(self, name)
            tmp = buf.new_zeros(B, H, W + 1, buf.shape[-1])
            tmp.scatter_(2, slot[..., None].expand(B, H, S, buf.shape[-1]), src.to(buf.dtype))
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
        if self.sliding_window is not None:
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
        for name, src in zip(self.planes, self.encode(k, v)):
            getattr(self, name).index_put_(where, src)
        self.pos.index_put_(where, positions[:, None, :].expand(B, H, S))

    def take_rows(self, rows: torch.Tensor) -> "LayerKVCache":
        """A new layer with only these batch rows (an index tensor): what a batch keeps when some of
        its rows leave (`structkv.serve.batcher`). A full-attention layer is compacted: each (row,
        head)'s entries move to the front in their order, empty slots after them, and the cursor
        becomes the most entries any of them holds, so a batch that keeps running does not keep
        the slots of rows that left (attention reads positions, not slot order). Rings are copied."""
        out = LayerKVCache(len(rows), self.pos.shape[1], self.capacity, self.head_dim, self.k.dtype, self.pos.device,
                           sliding_window=self.sliding_window, kv_dtype=self.kv_dtype)
        for name in (*self.planes, "pos"):
            getattr(out, name).copy_(getattr(self, name).index_select(0, rows))
        out.cursor.copy_(self.cursor)
        out.compact()
        out.take_queries(self, rows)
        return out

    def entry_bytes(self) -> int:
        """Bytes one (token, KV head) entry takes, K and V, scale tables included."""
        return sum(getattr(self, name)[0, 0, 0].numel() * getattr(self, name).element_size() for name in self.planes)

    def nbytes(self) -> int:
        """Bytes of K and V allocated (every plane)."""
        return self.entry_bytes() * self.pos.numel()

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
        return (*cache.read(k.dtype), cache.pos)

    def entries(self) -> list[int]:
        """Valid entries per layer, summed over batch rows and KV heads: one host read for all."""
        return torch.stack([(layer.pos >= 0).sum() for layer in self.layers]).tolist()

    def nbytes(self, used: bool = True) -> list[int]:
        """K+V bytes per layer: of the valid entries (used=True) or of the allocated buffers."""
        counts = self.entries() if used else [layer.pos.numel() for layer in self.layers]
        return [layer.entry_bytes() * n for layer, n in zip(self.layers, counts)]

    def free(self) -> int:
        """Tokens that can still be appended to every row (rings never fill)."""
        return min((layer.capacity - int(layer.cursor) for layer in self.layers if layer.sliding_window is None),
                   default=1 << 30)

    def clone(self) -> "KVCache":
        """An independent copy (compress once, ask many: each question extends its own copy)."""
        return copy.deepcopy(self)

    def take_rows(self, rows: list[int]) -> "KVCache":
        """A new cache with only these batch rows, in this order (the rest are dropped)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.layers[0].pos.device)
        out = KVCache()
        out.layers = nn.ModuleList(layer.take_rows(index) for layer in self.layers)
        return out


class StaticKVCache(KVCache):
    """One `LayerKVCache` per layer: `capacity` slots for full-attention layers, a window-sized ring
    for sliding-window layers."""

    def __init__(self, cfg, batch: int, capacity: int, dtype, device, kv_dtype: str | None = None):
        super().__init__()
        sliding = map(cfg.sliding_window_at, range(cfg.num_layers))
        rings = [w if w is not None and w < capacity else None for w in sliding]
        self.layers = nn.ModuleList(
            LayerKVCache(batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device, sliding_window=rings[i],
                         kv_dtype=kv_dtype)
            for i in range(cfg.num_layers)
        )


class StackedKVCache(KVCache):
    """The rows of several caches of one model as one batch, so one decode step serves them all
    (e.g. every method's compressed prompt: the weights are read once per step, not once per method).

    Full-attention layers are padded to a common capacity (the largest cursor plus `room`, by
    default the smallest free room of the parts, rounded up like every cache) and written at the
    largest cursor: a row with fewer entries keeps empty slots (position -1, never attended to).
    Sliding layers become rings of the window when any row has one, or when `sliding_windows` (the model's
    window per layer, `ModelConfig.sliding_window_at`) says the padded capacity would pass the window: a row
    whose layer is not a ring holds fewer than `window` positions, all of which fit the ring.
    """

    def __init__(self, caches: list, room: int | None = None, sliding_windows: list[int | None] | None = None):
        super().__init__()
        if not caches:
            raise ValueError("nothing to stack: give at least one cache")
        if len({len(c.layers) for c in caches}) != 1:
            raise ValueError("caches of different models (layer counts differ) cannot be stacked")
        sliding_windows = sliding_windows or [None] * len(caches[0].layers)
        self.layers = nn.ModuleList(_stack_layer([c.layers[i] for c in caches], room, sliding_windows[i])
                                    for i in range(len(caches[0].layers)))
        self.rows = [c.layers[0].k.shape[0] for c in caches]


def _stack_layer(parts: list[LayerKVCache], room: int | None = None, sliding_window: int | None = None) -> LayerKVCache:
    first = parts[0]
    _, H, _, _ = first.k.shape
    D, dtype, kv = first.head_dim, first.k.dtype, first.kv_dtype
    if any(p.k.shape[1] != H or p.head_dim != D or p.k.dtype != dtype or p.kv_dtype != kv for p in parts):
        raise ValueError("caches with different KV heads, head dims, dtypes or kv_dtypes cannot be stacked")
    batch = sum(p.k.shape[0] for p in parts)
    sliding_windows = {p.sliding_window for p in parts if p.sliding_window is not None}
    if len(sliding_windows) > 1:
        raise ValueError(f"sliding layers with different windows {sorted(sliding_windows)} cannot be stacked")
    flat = [p for p in parts if p.sliding_window is None]
    cursor = max((int(p.cursor) for p in flat), default=0)
    if room is None:
        room = min((p.capacity - int(p.cursor) for p in flat), default=0)
    if not sliding_windows and sliding_window is not None and cursor + room > sliding_window:
        sliding_windows = {sliding_window}  # plain buffers so far, but the stacked one would see past the window
    if sliding_windows:
        out = LayerKVCache(batch, H, 0, D, dtype, first.k.device, sliding_window=sliding_windows.pop(), kv_dtype=kv)
        row = 0
        for p in parts:
            b = p.k.shape[0]
            ring = LayerKVCache(b, H, 0, D, dtype, p.k.device, sliding_window=out.sliding_window, kv_dtype=kv)
            # sliding layers hold the same positions in every head
            ring._fill_ring(tuple(getattr(p, name) for name in p.planes), p.pos[:, 0])
            for name in (*out.planes, "pos"):
                getattr(out, name)[row:row + b] = getattr(ring, name)
            row += b
        return _stack_queries(out, parts)
    capacity = round_capacity(cursor + room)  # one decode graph per size
    out = LayerKVCache(batch, H, capacity, D, dtype, first.k.device, kv_dtype=kv)
    row = 0
    for p in parts:
        b, used = p.k.shape[0], int(p.cursor)
        for name in (*out.planes, "pos"):
            getattr(out, name)[row:row + b, :, :used] = getattr(p, name)[:, :, :used]
        row += b
    out.cursor.fill_(cursor)
    return _stack_queries(out, parts)


def _stack_queries(out: LayerKVCache, parts: list[LayerKVCache]) -> LayerKVCache:
    """Each part's kept decode queries (a decode-time KV bound's) in its rows of `out`."""
    row = 0
    for p in parts:
        out.take_queries(p, at=row)
        row += p.k.shape[0]
    return out
