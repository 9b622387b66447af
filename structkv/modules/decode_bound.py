"""A KV bound while generating: no layer holds more than `max_tokens` entries per row and KV head.

Why: a prompt's compression bounds what the prompt leaves behind, but every generated token
still adds one entry per layer, so a 4K-token answer, a reasoning trace or a long chat grows the
cache without limit. With a bound, a row's layer that is about to pass `max_tokens` evicts down
to `max_tokens - every` (hysteresis: the eviction runs once every `every` tokens, not at every
token). The first `sinks` positions and the last `recent` entries always stay; the others are
ranked by a decode-time rule (one class each in `structkv.modules.decode_rules`, registered by name):

- "window": SnapKV on generated tokens. The cache keeps the last 32 decode queries of
  every layer (`LayerKVCache.keep_queries`); an entry's score is the attention those queries gave
  it, summed over the query heads of its KV head.
- "redundancy": R-KV's idea. The same attention, blended half and half with the key's novelty:
  1 minus its largest cosine similarity to a later entry of its head, so of two keys that repeat
  each other the older one goes first (a reasoning trace repeats itself).
- "recent": the sinks and the most recent entries only (StreamingLLM), no scoring at all.
- "centrality" (the default): StructKV's centrality carried forward, chosen by the criterion
  written before its runs (lowest mean KL at bound 512 over 8 development record-model pairs:
  0.075 against "window" 0.117 and "recent" 0.149; research/results/decode_bound). A StructKV prefill
  leaves each prompt position's global in-degree centrality (decayed over depth, normalised to one
  layer's scale) in every layer's table (`LayerKVCache.carried`); while generating, each layer
  folds the attention its decode queries give each position into its table every 32 tokens (and
  before it evicts): C <- CARRY_DECAY * C + mean attention per new query, summed over heads. An
  entry's score is its position's C, shared by the layer's heads (one ranking per token, as
  StructKV's), so what the prompt's structure made central stays until the answer stops reading
  it. A full prefill under this rule is `Full(centrality=True)` (`structkv.methods.full`: the same
  cache and logits, exactly, with StructKV's centrality tracked) so the table exists; a state
  compressed by a method without centrality starts empty, and the rule is then a decayed
  in-degree over the decode queries.

Until the first decode query is kept (a prompt longer than the bound, evicted before the first
token) the query-based rules rank by novelty alone (the centrality rule by the prefill's table
when it has one). Rows evict independently (their own counts,
their own scores), so a batched row keeps exactly what it keeps alone. Eviction empties slots
(position -1); a full-attention layer is then compacted (`LayerKVCache.compact`) so its cursor
never passes the bound; a sliding-window ring keeps its slots and refills the emptied ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .decode_rules import RULES, DecodeRule, query_attention

QUERY_WINDOW = 32  # decode queries each layer keeps for the query-based rules
CARRY_DECAY = 0.9  # the "centrality" rule's decay per QUERY_WINDOW generated tokens (StructKV's depth decay)


MIN_TOKENS = 16  # below, sinks + recent entries + one eviction step leave nothing of the prompt


@dataclass(frozen=True)
class DecodeBound:
    """At most `max_tokens` entries per (row, KV head) in every layer while generating.

    `rule`: "window", "redundancy", "recent" or "centrality" (module docstring); `every`: tokens between
    evictions (the low mark is `max_tokens - every`); `sinks`, `recent`: first positions and
    latest entries that always stay. None: scaled to the bound (every max_tokens // 8 up to 64,
    sinks up to 4, recent up to 32, each at most a quarter of the bound)."""

    max_tokens: int
    rule: str = "centrality"  # chosen on the second development split (research/results/decode_bound)
    every: int | None = None
    sinks: int | None = None
    recent: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < MIN_TOKENS:
            raise ValueError(f"max_kv_tokens must be an int >= {MIN_TOKENS} (entries per layer while generating; "
                             "a smaller bound evicts the prompt itself before the first token), "
                             f"got {self.max_tokens!r}")
        if self.rule not in RULES:
            raise ValueError(f"unknown decode eviction rule {self.rule!r}: choose one of {', '.join(RULES)}")
        for name in ("every", "sinks", "recent"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if self.every == 0:
            raise ValueError("every must be >= 1 (tokens between evictions)")
        if self.low < self.n_sinks + self.n_recent:
            raise ValueError(f"max_kv_tokens={self.max_tokens} evicts down to {self.low}, fewer than the "
                             f"{self.n_sinks} sinks + {self.n_recent} recent entries that always stay: "
                             "raise max_kv_tokens or lower every / sinks / recent")

    @property
    def step(self) -> int:
        return self.every if self.every is not None else max(1, min(64, self.max_tokens // 8))

    @property
    def ranker(self) -> DecodeRule:
        """The registered rule this bound ranks entries by (`structkv.modules.decode_rules`)."""
        return RULES[self.rule]

    @property
    def low(self) -> int:
        """Entries a layer keeps after an eviction."""
        return self.max_tokens - self.step

    @property
    def n_sinks(self) -> int:
        return self.sinks if self.sinks is not None else min(4, self.max_tokens // 4)

    @property
    def n_recent(self) -> int:
        return self.recent if self.recent is not None else min(32, self.max_tokens // 4)

    @classmethod
    def of(cls, value) -> "DecodeBound | None":
        """A bound from `max_kv_tokens=`: None, an int, or a DecodeBound."""
        if value is None or isinstance(value, DecodeBound):
            return value
        return cls(value)


class BoundedDecode:
    """The bounds of one batch of rows on one cache: call `before_step()` before each decode step
    (it evicts the rows that would pass their bound) and `after_step()` after it. `stats()` gives
    the peak entries per layer (`kv_entries_max`), the evictions (layer x row events) and their time.

    `bounds`: one `DecodeBound` (or None: unbounded) per row; `group`: query heads per KV head;
    `reduce`: sums a tensor over tensor-parallel ranks (None: one process), so the centrality rule's
    sum over heads counts every rank's heads. A full-attention layer whose rows are all bounded is
    sized to the largest bound (room for it + 1) once its entries fit: a long prompt's buffer
    shrinks at its first eviction, a state's grows when its room runs out."""

    def __init__(self, bounds: list, cache, group: int, reduce=None):
        self.bounds, self.cache, self.reduce = list(bounds), cache, reduce
        self.counts = [_entries_per_row(layer) for layer in cache.layers]  # per layer: (B,) ints
        # Host copies of what each step changes by a known amount (a full layer's cursor, the rows'
        # fed positions), so a step reads the device only when it evicts: no sync per layer per token.
        self.cursors = [int(layer.cursor) for layer in cache.layers]
        self.fed = None  # (B,) the position each row was fed last, read once at the first step
        self.peak = [0] * len(self.counts)  # over decode steps
        self.evictions, self.evict_s = 0, 0.0
        carrying = [r for r, b in enumerate(self.bounds) if b is not None and b.ranker.carries]
        self.carrying = carrying  # rows whose layers fold their queries into the carried centrality
        if any(b is not None and b.ranker.needs_queries for b in self.bounds):
            for layer in cache.layers:
                layer.keep_queries(QUERY_WINDOW, layer.pos.shape[1] * group)  # this rank's query heads
                if carrying:
                    layer.carry_centrality(int(layer.pos.max()) + 1)

    def before_step(self) -> None:
        t0 = time.perf_counter()
        for i, layer in enumerate(self.cache.layers):
            over = [r for r, (n, b) in enumerate(zip(self.counts[i], self.bounds))
                    if b is not None and n + 1 > b.max_tokens]
            full = layer.sliding_window is None
            for bound in {self.bounds[r] for r in over}:
                group = [r for r in over if self.bounds[r] == bound]
                if bound.ranker.carries:
                    fold(layer, group, self.reduce)
                _evict(layer, group, bound)
            if over:
                self.evictions += len(over)
                self.counts[i] = _entries_per_row(layer)
            if full and (over or self.cursors[i] + 1 > layer.capacity):
                layer.compact()
                self.cursors[i] = int(layer.cursor)  # one read, after an eviction only
                self._fit(i, layer)
        if self.evictions:
            self.evict_s += time.perf_counter() - t0

    def _fit(self, i: int, layer) -> None:
        """Give a full layer exactly its rows' bound's room once its entries fit it (a compiled
        step sees one more shape, once); not when a row is unbounded."""
        from ..models.kv_cache import round_capacity

        if any(b is None for b in self.bounds):
            if self.cursors[i] + 1 > layer.capacity:
                raise ValueError("an unbounded row has no room left in this cache")
            return
        most = max(b.max_tokens for b in self.bounds)
        want = round_capacity(most + 1)
        if layer.capacity != want and self.cursors[i] <= most:
            fitted = layer.resized(want)
            fitted.take_queries(layer)
            self.cache.layers[i] = fitted

    def after_step(self) -> None:
        for i, layer in enumerate(self.cache.layers):
            cap = layer.capacity if layer.sliding_window is not None else None
            self.counts[i] = [n + 1 if cap is None else min(n + 1, cap) for n in self.counts[i]]
            self.peak[i] = max(self.peak[i], max(self.counts[i], default=0))
            if cap is None:
                self.cursors[i] += 1  # the step wrote one entry at the cursor
        if not self.carrying:
            return
        t0 = time.perf_counter()
        if self.fed is None:  # each row's position just fed: read once, then one more a step
            self.fed = self.cache.layers[0].q_pos.amax(-1).tolist()
        else:
            self.fed = [p + 1 for p in self.fed]
        due = [r for r in self.carrying if (self.fed[r] + 1) % QUERY_WINDOW == 0]  # by position: a row's own cadence
        for layer in self.cache.layers if due else ():
            fold(layer, due, self.reduce)
        if due:
            self.evict_s += time.perf_counter() - t0

    def stats(self) -> dict:
        bound = next((b for b in self.bounds if b is not None), None)
        return {"max_kv_tokens": bound.max_tokens if bound else None,
                "decode_evict_rule": bound.rule if bound else None,
                "kv_entries_max": list(self.peak), "kv_evictions": self.evictions, "kv_evict_s": self.evict_s}


def _entries_per_row(layer) -> list[int]:
    """The most entries any KV head of each row holds, (B,) as ints."""
    return (layer.pos >= 0).sum(-1).amax(-1).tolist()


def _evict(layer, rows: list[int], bound: DecodeBound) -> None:
    """Empty all but `bound.low` entries of each (row, head) of `rows`: the sinks, the recent and
    the best by the bound's rule stay (position -1 marks the rest)."""
    index = torch.tensor(rows, device=layer.pos.device)
    pos = layer.pos.index_select(0, index)  # (R, Hkv, C)
    valid = pos >= 0
    score = bound.ranker.scores(layer, index, pos).masked_fill(~valid, float("-inf"))
    score = score.masked_fill(pinned(pos, bound.n_sinks, bound.n_recent), float("inf"))
    keep = score.topk(min(bound.low, pos.shape[-1]), dim=-1).indices  # (R, Hkv, low)
    stay = torch.zeros_like(valid).scatter_(-1, keep, True) & valid
    layer.pos[index] = pos.masked_fill(~stay, -1)


def pinned(pos: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """(R, H, C) bool: the `sinks` earliest and `recent` latest positions of each (row, head)."""
    valid = pos >= 0
    key = pos.masked_fill(~valid, torch.iinfo(pos.dtype).max)
    rank = key.argsort(-1).argsort(-1)  # 0 = earliest position
    n = valid.sum(-1, keepdim=True)
    return valid & ((rank < sinks) | (rank >= n - recent))


def fold(layer, rows: list[int], reduce=None) -> None:
    """Fold the queries `rows` kept since their last fold into the layer's carried centrality:
    C <- CARRY_DECAY^(new / QUERY_WINDOW) * C + the mean attention per new query, summed over the
    layer's heads (every rank's, through `reduce`) onto positions."""
    index = torch.tensor(rows, device=layer.pos.device)
    q_pos = layer.q_pos.index_select(0, index)  # (R, n)
    new = q_pos > layer.carried_upto.index_select(0, index)[:, None]  # (R, n)
    pos = layer.pos.index_select(0, index)  # (R, Hkv, C)
    layer.carry_centrality(int(pos.max()) + 1)
    k = layer.read(torch.float32)[0].index_select(0, index).float()  # (R, Hkv, C, D)
    count = new.sum(-1)  # (R,)
    attention = query_attention(layer, index, k, pos, q_pos.masked_fill(~new, -1))  # (R, Hkv, C)
    attention = attention / count.clamp_min(1)[:, None, None]
    step = torch.zeros(len(rows), layer.carried.shape[1], device=pos.device)  # (R, P)
    step.scatter_add_(1, pos.clamp_min(0).flatten(1), attention.masked_fill(pos < 0, 0).flatten(1))
    if reduce is not None:
        step = reduce(step)
    factor = CARRY_DECAY ** (count.float() / QUERY_WINDOW)  # (R,)
    layer.carried[index] = layer.carried.index_select(0, index) * factor[:, None] + step
    layer.carried_upto[index] = torch.maximum(q_pos.amax(-1), layer.carried_upto.index_select(0, index))


def seed_centrality(cache, centrality: torch.Tensor, positions: torch.Tensor) -> None:
    """Put a StructKV prefill's centrality, C (B, N) on the prompt's columns at `positions` (B, N;
    -1 padding) at one layer's scale (`CentralityTracker.per_layer`), into every layer's carried
    table: the "centrality" rule's start."""
    size = int(positions.max()) + 1
    table = torch.zeros(positions.shape[0], size + 1, device=positions.device)  # the last column takes padding
    table.scatter_(1, torch.where(positions >= 0, positions, size), centrality.float())
    for layer in cache.layers:
        layer.carry_centrality(size)
        layer.carried[:, :size] = table[:, :size]
