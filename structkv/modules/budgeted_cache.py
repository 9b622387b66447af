"""BudgetedKVCache: per-layer, per-KV-head caches of fixed capacity, filled from selected indices.

Full-attention layers get `budget + room` slots (rounded up to a multiple of 64) (room: generated and question tokens), filled at
prefill by `compact_kv` from each layer's own selection and appended to at decode at the layer's
cursor. Sliding-window layers keep their exact window as a ring. All shapes are static, so the
compiled decode step (`Decoder.decode_step`) compiles once, whatever the budgets.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.kv_cache import LayerKVCache, round_capacity
from ..ops import compact_kv
from .selection import pads_last


class BudgetedKVCache(nn.Module):
    """Shapes: B batch, Hkv KV heads, C_l capacity of layer l, D head dim.

    Args:
        cfg: ModelConfig. batch: B. budgets: entries kept at prefill per layer (max over rows;
            ignored for sliding layers). room: extra slots for tokens appended after prefill.
    """

    def __init__(self, cfg, batch: int, budgets: list[int], room: int, dtype, device):
        super().__init__()
        if len(budgets) != cfg.num_layers:
            raise ValueError(f"need one budget per layer ({cfg.num_layers}), got {len(budgets)}")
        layers = []
        for i, budget in enumerate(budgets):
            window = cfg.window(i)
            ring = window is not None and window < budget + room
            capacity = round_capacity(budget + room)
            layers.append(LayerKVCache(batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device,
                                       window=window if ring else None))
        self.layers = nn.ModuleList(layers)
        self.register_buffer("lengths", torch.zeros(cfg.num_layers, batch, cfg.num_kv_heads, dtype=torch.long,
                                                    device=device))

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             indices: torch.Tensor | None) -> None:
        """Store layer `layer`'s prompt entries: all of them (indices None, or a ring layer) or the
        selected ones, indices (B, Hkv, M) sorted with -1 left padding."""
        cache = self.layers[layer]
        if indices is None or cache.window is not None:
            cache.fill(k, v, positions)
            self.lengths[layer] = (cache.pos >= 0).sum(-1)
            return
        compact_kv(cache.k, cache.v, cache.pos, self.lengths[layer], k, v, positions, pads_last(indices))
        cache.cursor.fill_(indices.shape[-1])

    def entries(self) -> list[int]:
        """Valid (non-empty) entries per layer, summed over batch rows and KV heads."""
        return [int((layer.pos >= 0).sum()) for layer in self.layers]

    def nbytes(self, used: bool = True) -> list[int]:
        """K+V bytes per layer: of the valid entries (used=True) or of the allocated buffers."""
        out = []
        for layer in self.layers:
            per_entry = 2 * layer.k.shape[-1] * layer.k.element_size()
            out.append(per_entry * (int((layer.pos >= 0).sum()) if used else layer.pos.numel()))
        return out

    def clone(self) -> "BudgetedKVCache":
        """An independent copy (compress once, ask many: each question extends its own copy)."""
        import copy

        return copy.deepcopy(self)
