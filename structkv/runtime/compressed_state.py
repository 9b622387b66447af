"""A prompt compressed once (`CompressedState`) and the statistics of its prefill (`prefill_stats`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..methods import Method
from ..modules.budgeted_cache import BudgetedKVCache
from ..util.timing import Timer
from .stats import PrefillStats


@dataclass
class CompressedState:
    """A prompt compressed once: the cache, the last logits and where positions continue."""

    cache: BudgetedKVCache
    logits: torch.Tensor  # (B, V) float32, next-token logits after the prompt
    next_positions: torch.Tensor  # (B, 1) position of the next token per row
    lengths: list[int]  # prompt tokens per row
    method: Method
    stats: PrefillStats | None = None
    kept_columns: torch.Tensor | None = None  # (B, K) prompt columns that reached the last layer, -1 = pad
    source: object = None  # weakref to the model that made it: a state only makes sense on that model
    messages: list | None = None  # the chat messages it holds, when made from messages
    archive: object = None  # a `KVArchive` of the entries the method evicted (ask-time recall), or None
    recall: float | int | None = None  # entries each archived layer recalls per question by default (a `Budget`)

    def check_model(self, model) -> None:
        """Refuse to extend this state with a model other than the one that made it."""
        if self.source is not None and self.source() is not model:
            raise ValueError("this compressed state was made by another model; call structkv.prefill(model, context, "
                             "method) with the model you generate with")

def prefill_stats(model, method, lengths, processed, cache, prop, prefill_s: float, timer: Timer,
                  extra_pass: dict | None = None) -> PrefillStats:
    """`extra_pass`: tokens and seconds of a store's second pass over the prompt (`Retention.extra_pass`,
    a reconstruction), counted at every layer in `tokens_per_layer` and the prefill fraction: it is
    prefill work."""
    cfg = model.config
    if extra_pass is not None:
        processed = [p + extra_pass["tokens"] for p in processed]
    pivots = prop.pivots if prop is not None else [None] * len(lengths)
    kept = cache.nbytes()
    totals = timer.totals if timer.enabled else None
    prompt = lengths.tolist()
    return PrefillStats(
        method=method.name, prompt_tokens=prompt, tokens_per_layer=processed,
        prefill_fraction=sum(processed) / (cfg.num_layers * sum(prompt)),
        pivot_layer=pivots if len(pivots) > 1 else pivots[0], kv_entries_per_layer=cache.entries(),
        kv_bytes_per_layer=kept, kv_bytes_allocated_per_layer=cache.nbytes(used=False),
        kv_bytes_full_layers=sum(kept[i] for i in cfg.full_attention_layers), prefill_s=prefill_s,
        host_syncs=prop.host_syncs if prop is not None else 0,
        reconstruction_tokens=extra_pass["tokens"] if extra_pass else None,
        reconstruction_s=extra_pass["seconds"] if extra_pass else None,
        scoring_s=totals["scoring"] if totals else None,
        selection_s=totals["selection"] + totals["propagation"] if totals else None,
        cache_fill_s=totals["cache_fill"] if totals else None,
        **_tp_stats(model, kept), **(prop.stats() if prop is not None else {}))

def _tp_stats(model, kept: list[int]) -> dict:
    """Under tensor parallelism: the ranks and the kept bytes of all of them (one all-reduce)."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return {}
    total = tp.all_reduce(torch.tensor([sum(kept)], dtype=torch.float64, device=model.device))
    return {"tp_ranks": tp.world, "kv_bytes_all_ranks": int(total.item())}
