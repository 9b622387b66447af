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

from ..ops import cpu_decode, decode_attention, visible
from ..ops.kv_quant import (
    TABLE_DTYPES,
    TABLES,
    check_kv_dtype,
    code_dtype,
    code_width,
    dequantize_kv,
    quantize_kv,
    quantized_decode_attention,
    table_width,
)

# Cache capacities are rounded up to a multiple of this, so prompts of similar length share one
# compiled decode graph (the extra slots stay empty, position -1, never attended to).
CAPACITY_MULTIPLE = 64


def round_capacity(slots: int) -> int:
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


class LayerKVCache(nn.Module):
    """One layer's entries: planes k, v (B, Hkv, C, D) in a float dtype, or, with `kv_dtype`
    "int8" / "int4", their codes and per-entry scale tables (`structkv.ops.kv_quant`: k and v hold
    the codes, k_scale / v_scale (and k_min / v_min) are (B, Hkv, C, 1 or D/32)); pos (B, Hkv, C) the
    original position of every slot (-1 empty). Every write quantizes once, on the way in."""

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

    def _kernel_kind(self, q: torch.Tensor) -> str | None:
        """The CPU decode kernel's name for this layer's entries, or None where it does not apply."""
        kind = self.kv_dtype or str(self.k.dtype).removeprefix("torch.")
        return kind if self.kernel and cpu_decode.fits(q, self.k) and kind in cpu_decode.KINDS else None

    def attend(self, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token per row over this layer's entries: q (B, Hq, 1, D), mask (B, 1|Hkv, 1, C)
        -> (B, Hq, 1, D). On CPU, where it is built, the decode kernel reads every kind of entry
        (`structkv::cpu_decode_attention`); otherwise float entries go to SDPA (`decode_attention`)
        and quantized ones to `structkv::quantized_decode_attention`."""
        kind = self._kernel_kind(q)
        if kind is not None:
            k_planes, v_planes = self._sides()
            return torch.ops.structkv.cpu_decode_attention(q, k_planes, v_planes, mask, scale, kind, self.threads)
        if self.kv_dtype is None:
            return decode_attention(q, self.k, self.v, mask, scale, self.threads)
        k_planes, v_planes = self._sides()
        return quantized_decode_attention(q, k_planes, v_planes, mask, scale, self.kv_dtype)

    def attention(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """New tokens q (B, Hq, S, D), k, v (B, Hkv, S, D) at `positions` (B, S) attend to the entries
        and causally to each other, and are appended: (B, S, E) after `attn`'s output projection.
        One token is written first and reads the buffer in place (decode); several attend over
        entries + new and are written after (a ring could otherwise overwrite keys an earlier new
        token still sees)."""
        if q.shape[2] == 1:
            if self.query_slots:
                self._keep_query(q * attn.scale, positions)
            self.write(k, v, positions)
            kind = self._kernel_kind(q)
            if kind is not None:  # the kernel decides from the slots' positions: no mask built a layer
                k_planes, v_planes = self._sides()
                out = torch.ops.structkv.cpu_decode_attention_at(q, k_planes, v_planes, self.pos, positions,
                                                                 attn.sliding_window or 0, attn.scale, kind,
                                                                 self.threads)
            else:
                out = self.attend(q, visible(positions, self.pos, attn.sliding_window), attn.scale)  # (B, Hq, 1, D)
            return attn.o_proj(out.reshape(q.shape[0], 1, -1))
        old_k, old_v = self.read(k.dtype)
        new_pos = positions[:, None].expand(-1, k.shape[1], -1)  # (B, Hkv, S)
        keys = (torch.cat([old_k, k], 2), torch.cat([old_v, v], 2), torch.cat([self.pos, new_pos], 2))
        out = attn.attend(q, keys[0], keys[1], visible(positions, keys[2], attn.sliding_window))
        self.write(k, v, positions)
        return out

    def keep_queries(self, slots: int, num_heads: int) -> None:
        """Keep the last `slots` decode queries, already scaled, in a ring: q_recent (B, Hq, slots,
        D) float32 and q_pos (B, slots) (-1 empty). What a decode-time eviction scores the entries
        with (`structkv.modules.decode_bound`: SnapKV's observation window, on generated tokens)."""
        if self.query_slots == slots:
            return
        B, device = self.pos.shape[0], self.pos.device
        self.query_slots = slots
        self.register_buffer("q_recent", torch.zeros(B, num_heads, slots, self.head_dim, device=device))
        self.register_buffer("q_pos", torch.full((B, slots), -1, dtype=torch.long, device=device))

    def take_queries(self, other: "LayerKVCache", rows: torch.Tensor | None = None, at: int = 0) -> None:
        """Carry `other`'s decode-time memory, its kept queries and its carried centrality (its
        `rows`, default all), into this layer's rows from `at`."""
        if other.query_slots:
            self.keep_queries(other.query_slots, other.q_recent.shape[1])
            q, qp = (other.q_recent, other.q_pos) if rows is None else (other.q_recent[rows], other.q_pos[rows])
            self.q_recent[at:at + q.shape[0]] = q
            self.q_pos[at:at + q.shape[0]] = qp
        if other.carried is not None:
            c, u = other.carried, other.carried_upto
            if rows is not None:
                c, u = c[rows], u[rows]
            self.carry_centrality(c.shape[1])
            self.carried[at:at + c.shape[0], :c.shape[1]] = c
            self.carried_upto[at:at + c.shape[0]] = u

    def carry_centrality(self, positions: int) -> None:
        """Hold a score per position, carried (B, P >= `positions`) float32, across decode steps (the
        "centrality" rule of `structkv.modules.decode_bound`: StructKV's centrality from the prefill,
        accumulated over decode queries); grown, never shrunk. A table per position, not per slot,
        so compaction, resizing and rings leave it as it is."""
        B, device = self.pos.shape[0], self.pos.device
        if self.carried is None:
            self.carried = torch.zeros(B, positions, device=device)
            self.carried_upto = torch.full((B,), -1, dtype=torch.long, device=device)
        elif self.carried.shape[1] < positions:
            self.carried = torch.nn.functional.pad(self.carried, (0, positions - self.carried.shape[1]))

    def _keep_query(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one scaled query per row, q (B, Hq, 1, D) at positions (B, 1), into the ring."""
        B, Hq = q.shape[:2]
        slot = torch.remainder(positions, self.query_slots)  # (B, 1)
        rows = torch.arange(B, device=q.device).view(B, 1)
        heads = torch.arange(Hq, device=q.device).view(1, Hq, 1)
        self.q_recent.index_put_((rows[:, None], heads, slot[:, None]), q.float())  # (B, Hq, 1) <- (B, Hq, 1, D)
        self.q_pos.index_put_((rows, slot), positions)

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
