"""BudgetedKVCache: the cache a compression method fills, a capacity per layer.

Its own module beside the method modules because it is where a method's selection lands
(`compact_kv` of the kept entries, the evicted ones to an archive); the decoder only needs the
`KVCache` interface it shares with the plain caches (`structkv.models.kv_cache`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.kv_cache import KVCache, LayerKVCache, round_capacity
from ..ops import compact_kv


class BudgetedKVCache(KVCache):
    """A capacity per layer, filled at prefill from each layer's own selection (`compact_kv`) and
    appended to at decode at the layer's cursor; a sliding layer whose window is smaller than its
    capacity keeps its exact window as a ring. All shapes are static, so the compiled decode step
    compiles once, whatever the budgets.

    Args: batch B, num_kv_heads Hkv, head_dim D; capacities: slots per layer; rings: the window of
    each layer kept as a ring (None = a plain buffer); kv_dtype: "int8" / "int4" entries
    (`structkv.ops.kv_quant`) or None (`dtype` floats). `for_model` sizes it from a model config.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, capacities: list[int],
                 rings: list[int | None], dtype, device, kv_dtype: str | None = None):
        super().__init__()
        if len(capacities) != len(rings):
            raise ValueError(f"need one ring setting per layer: {len(capacities)} capacities, {len(rings)} rings")
        self.layers = nn.ModuleList(LayerKVCache(batch, num_kv_heads, capacity, head_dim, dtype, device,
                                                 sliding_window=ring, kv_dtype=kv_dtype)
                                    for capacity, ring in zip(capacities, rings))
        # `archive_kind` set (`structkv.models.archive`): what each selection drops is kept in `evicted`
        # (layer -> ArchiveLayer), taken out by the prefill into its state's archive
        self.archive_kind, self.evicted = None, {}

    @classmethod
    def for_model(cls, cfg, batch: int, budgets: list[int], room: int, dtype, device, num_kv_heads: int | None = None,
                  head_dim: int | None = None, kv_dtype: str | None = None) -> "BudgetedKVCache":
        """`budgets`: entries kept at prefill per layer (max over rows); `room`: slots for tokens
        appended later (generated and question tokens). Capacities are rounded up like every cache; a
        sliding layer is a ring of its window when prompt and room would not fit the window. `cfg`:
        a `ModelConfig`, or a `Layout` of a decoder of your own (no sliding layers; give
        `num_kv_heads` and `head_dim`)."""
        if len(budgets) != cfg.num_layers:
            raise ValueError(f"need one budget per layer ({cfg.num_layers}), got {len(budgets)}")
        sliding_window = getattr(cfg, "sliding_window_at", lambda i: None)
        sliding_windows = [sliding_window(i) for i in range(cfg.num_layers)]
        rings = [w if w is not None and w < b + room else None for w, b in zip(sliding_windows, budgets)]
        return cls(batch, num_kv_heads or cfg.num_kv_heads, head_dim or cfg.head_dim,
                   [round_capacity(b + room) for b in budgets], rings, dtype, device, kv_dtype)

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             indices: torch.Tensor | None, check: bool = True) -> None:
        """Store layer `layer`'s prompt entries: all of them (indices None, or a ring layer) or the
        selected ones, indices (B, Hkv, M) sorted with -1 left padding. `check`: validate the index
        lists (a host sync; callers that built them with `select_tokens` may skip it)."""
        cache = self.layers[layer]
        if indices is None or cache.sliding_window is not None:
            cache.fill(k, v, positions)
            return
        if self.archive_kind is not None:
            from ..models.archive import pack

            self.evicted[layer] = pack(self.archive_kind, k, v, positions, indices)
        indices, planes, half = pads_last(indices), cache.encode(k, v), len(cache.planes) // 2
        names = cache.planes
        for i in range(half):  # codes, then each scale table: the same gather
            compact_kv(getattr(cache, names[i]), getattr(cache, names[half + i]), cache.pos, planes[i],
                       planes[half + i], positions, indices, check=check and i == 0)
        cache.cursor.fill_(indices.shape[-1])


def pads_last(indices: torch.Tensor) -> torch.Tensor:
    """Move -1 entries from the front to the end (the layout `compact_kv` expects)."""
    big = torch.iinfo(torch.long).max
    moved = torch.where(indices < 0, torch.full_like(indices, big), indices).sort(-1).values
    return torch.where(moved == big, torch.full_like(moved, -1), moved)
