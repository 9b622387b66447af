"""PrefillStats: what a compressed prefill did and kept, typed.

One record per compressed prompt (batch rows as lists). Read it as attributes, or as a mapping
(`stats["prefill_fraction"]`, `dict(stats)`) where tables and JSON records want names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class PrefillStats:
    method: str
    prompt_tokens: list[int]  # per row
    tokens_per_layer: list[int]  # tokens computed at each layer (rows summed)
    prefill_fraction: float  # token-layers computed / (layers x prompt tokens)
    pivot_layer: int | list | None  # where tokens were propagated (per row when B > 1)
    kv_entries_per_layer: list[int]  # entries kept (rows and KV heads summed)
    kv_bytes_per_layer: list[int]  # bytes of the kept entries
    kv_bytes_allocated_per_layer: list[int]  # bytes of the cache buffers (kept + empty + room)
    kv_bytes_full_layers: int  # kept bytes of the full-attention layers
    prefill_s: float  # wall time; in a shared prefill, what the method would have cost alone
    host_syncs: int  # host decisions (pivot, fixed propagation layer)
    scoring_s: float | None = None  # phase times: None unless a Timer was asked for
    selection_s: float | None = None
    cache_fill_s: float | None = None
    reconstruction_tokens: int | None = None  # KVzip: tokens run to repeat the context (rows summed)
    reconstruction_s: float | None = None  # and the seconds it took (inside prefill_s)
    t_curve: dict | list | None = None  # StructKV's pivot statistic per layer (per row when B > 1)
    centrality_layers: list[int] | None = None  # layers summed into StructKV's centrality
    shared_prefill: dict | None = None  # methods, lanes, pass_s, untimed_s of a shared prefill
    tp_ranks: int | None = None  # tensor parallelism: ranks; the kv_* fields above are this rank's
    kv_bytes_all_ranks: int | None = None  # kept bytes summed over every rank

    @property
    def kv_bytes(self) -> int:
        """Bytes of every kept entry."""
        return sum(self.kv_bytes_per_layer)

    # ------------------------------------------------------------------ mapping view
    def keys(self) -> list[str]:
        present = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        return present + ["kv_bytes"]

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def as_dict(self) -> dict:
        return dict(self.items())
