"""One method's share of a prefill (`MethodPass`, made by `prepare`) and the per-layer sequence
every prefill runs for the methods of one lane (`layer_steps`): the shared pass
(`structkv.runtime.lanes`), `structkv.hf` and a decoder of your own."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..methods import Method
from ..modules.budgeted_cache import BudgetedKVCache
from .ledger import UNTIMED


@dataclass
class MethodPass:
    """One method's share of a prefill: its per-layer KV plan, its propagation (None: none) and
    the `Retention` that fills its `BudgetedKVCache` (None when the propagation restarts: the
    restart makes the cache). `prepare` makes one; a decoder of your own calls `layer(view)`
    after each layer and `finish()` after the last (the prefill loop does the same, timed)."""

    method: Method
    plan: dict[int, list[int]]
    prop: object
    store: object

    @property
    def cache(self) -> BudgetedKVCache:
        return self.store.cache

    def layer(self, view) -> torch.Tensor | None:
        """Store layer `view.layer`'s entries, let the propagation see it; the kept token indices
        (B, K) when it propagates here (gather the hidden states with `prop.pruner.gather`)."""
        return layer_steps([self], self.prop, view)

    def finish(self, model=None, tokens=None) -> None:
        """After the last layer: entries a retention held for later are chosen now (a guide that
        never came, scores that need the whole prompt)."""
        self.store.finish(model, tokens)

def prepare(method: Method, layout, lengths: torch.Tensor, num_kv_heads: int, head_dim: int, room: int,
            dtype=torch.float32, device=None, num_tokens: int | None = None, kv_dtype: str | None = None,
            archive: str | None = None) -> MethodPass:
    """`method`'s plan, propagation and cache for prompts of `lengths` (B,) tokens on a model of
    `layout` (a `ModelConfig`, or a `Layout` for a decoder of your own: every layer full
    attention), `room` free slots per layer after the kept entries. `num_tokens`: the prompt's
    columns (padding included; default the longest row); `kv_dtype`: the cache's entries
    (`BudgetedKVCache`); `archive`: keep the evicted entries in this kind (`structkv.models.archive`)."""
    num_tokens = int(lengths.max()) if num_tokens is None else num_tokens
    plan, prop = method.kv_plan(layout, lengths), method.propagation(layout, lengths)
    if prop is not None:
        prop.begin(num_tokens, device)
    if prop is not None and prop.restart:
        if archive is not None:
            raise ValueError(f"{method.name} re-encodes only the tokens it keeps, so nothing it drops has entries to "
                             "archive; use archive=None or a method that evicts entries")
        return MethodPass(method, plan, prop, None)
    budgets = [max(plan[i]) if i in plan else num_tokens for i in range(layout.num_layers)]
    cache = BudgetedKVCache.for_model(layout, len(lengths), budgets, room, dtype, device, num_kv_heads, head_dim,
                                      kv_dtype)
    cache.archive_kind = archive
    return MethodPass(method, plan, prop, method.retention(plan, cache))

def layer_steps(members, prop, view, account=None) -> torch.Tensor | None:
    """The per-layer sequence of every prefill, for the methods of one lane (they compute the same
    tokens): each method's store keeps the layer's entries, the propagation sees the layer, each
    store then sees the propagation (a guided retention selects its held layers once a guide
    exists). Returns the kept token indices (B, K) when the propagation fires here. `members`:
    objects with a `store` (a `Retention`, or None when the propagation restarts); `account`: what
    times each step (the shared pass's `LaneAccount`), None: untimed."""
    account = account or UNTIMED
    for m in members:
        with account.store(m, view):
            if m.store is not None:
                m.store.layer(view)
    if prop is None:
        return None
    with account.propagation(members, prop):
        kept = prop.after_layer(view)
    if not prop.restart:
        for m in members:
            if m.store is not None:
                with account.selection(m):
                    m.store.after_propagation(prop)
    return kept
