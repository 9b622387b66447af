"""Continuous batching: the running requests decode together, one step for all of them.

Why: a decode step reads every weight once whatever the batch, and on a CPU (or a GPU at small
batch) it is bound by those reads, so N requests decoding together cost little more per step than
one. Each request is prefilled alone (`structkv.runtime.generation.start`: its own method and budgets, or
its cached context extended by the question) and then joins the batch between two steps; its cache
rows are stacked with the others' (`StackedKVCache`: different lengths, methods and budgets share
one step, empty slots masked). Every row samples with its own settings and generator, stops on its
own EOS, stop strings, token limit or cancellation, and leaves; the cache is restacked only when
the batch's membership changes (one copy of the running caches per join or leave), and each restack
compacts the rows that stay (`KVCache.take_rows`), so a batch that never empties holds its rows'
entries plus room, not every slot of every row that has left.

A request alone in the batch gets exactly what `generate` gives it alone (the same prefill, the
same sampling calls on the same generator); in a batch its greedy tokens match `generate` up to
the float rounding of a batched matrix product.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..models.kv_cache import StackedKVCache
from ..runtime.decoding import Decoding, bounded, eos_ids, sample, step_function
from ..runtime.generation import Started


@dataclass
class Row:
    """One request in the batch: its sampling settings, what it has produced, and `on_token`,
    called with each new token id (None when the row ends on EOS); returning True ends the row
    (a stop string, a cancelled client)."""

    started: Started
    max_new: int
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    on_token: object = None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" (EOS, stop string, cancelled) or "length"
    tag: object = None  # the caller's own record of the request
    joined: float = field(default_factory=time.perf_counter)
    peers: int = 1  # the most rows it decoded with
    generator: torch.Generator | None = None
    bound: object = None  # a `DecodeBound` while generating (None: unbounded)
    error: Exception | None = None  # what ended this row alone (finish "error"); the others went on

    def __post_init__(self):
        if self.seed is not None:
            self.generator = torch.Generator(device=self.started.logits.device).manual_seed(self.seed)

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.tokens)

    def take(self, token: int, eos: set[int]) -> bool:
        """Record one sampled token; True when the row ends with it."""
        if token in eos:
            self.finish = "stop"
            if self.on_token is not None:
                self.on_token(None)
            return True
        self.tokens.append(token)
        if self.on_token is not None and self.on_token(token):
            self.finish = "stop"
        elif self.remaining == 0:
            self.finish = "length"
        return self.finish is not None


class Batch:
    """The running rows and their stacked cache. `join` adds a prefilled request (it samples its
    first token at the next `step`); `step` samples one token for every row, retires the rows that
    ended and feeds the others' tokens through one decode step. Rows are in join order.

    Args: model; compile: the decode step's backend (None: eager; compiled, one graph per row class
    serves every batch size and cache capacity: `structkv.runtime.decoding.compiled_batch_decode`).
    """

    def __init__(self, model, compile: str | None = None):
        self.model = model
        self.step_fn = step_function(compile, rows_vary=True)
        self.rows: list[Row] = []
        self.running: Decoding | None = None  # the rows fed at the last step: stacked cache, logits, positions
        self.joining: list[Row] = []  # rows added since the last step: their own caches, not stacked yet
        cfg = model.config
        self.sliding_windows = [cfg.sliding_window_at(i) for i in range(cfg.num_layers)]
        self.eos = set(eos_ids(model))

    @property
    def cache(self):
        """The StackedKVCache of the rows fed at the last step (None: none yet)."""
        return self.running.cache if self.running is not None else None

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    def join(self, row: Row) -> None:
        self.joining.append(row)

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One token for every row; returns the rows that ended (removed from the batch)."""
        rows = self.rows + self.joining
        if not rows:
            return []
        for r in rows:
            r.peers = max(r.peers, len(rows))
        fed = self.running.logits if self.running is not None else None
        logits = torch.cat([x for x in (fed, *(r.started.logits for r in self.joining)) if x is not None])
        tokens = torch.cat([self._sample(r, logits[i:i + 1]) for i, r in enumerate(rows)])  # (R,)
        ended = [self._take(r, t) for r, t in zip(rows, tokens.tolist())]
        keep = [i for i, e in enumerate(ended) if not e]
        if keep:
            self._restack(keep)
            self.running.feed(tokens[keep])
        else:
            self.running = None
        self.rows, self.joining = [rows[i] for i in keep], []
        return [r for r, e in zip(rows, ended) if e]

    @staticmethod
    def _sample(row: Row, logits: torch.Tensor) -> torch.Tensor:
        """Row's next token (1,); a row whose sampling fails ends alone (its token is never fed)."""
        try:
            return sample(logits, row.temperature, None, row.top_p, row.generator)
        except Exception as e:  # noqa: BLE001 - one row's failure is that row's answer, not the batch's
            row.error = e
            return torch.zeros(1, dtype=torch.long, device=logits.device)

    def _take(self, row: Row, token: int) -> bool:
        """`row.take`, with a failure (its callback, its stop strings) ending that row alone."""
        if row.error is None:
            try:
                return row.take(token, self.eos)
            except Exception as e:  # noqa: BLE001
                row.error = e
        row.finish = "error"
        return True

    def cancel_all(self) -> list[Row]:
        """End every row (shutdown); returns them."""
        rows = self.rows + self.joining
        for r in rows:
            r.finish = r.finish or "stop"
        self.rows, self.joining, self.running = [], [], None
        return rows

    def _restack(self, keep: list[int]) -> None:
        """The cache and positions of the rows in `keep` (indices into running + joining rows),
        stacked again unless no row joined or left since the last step."""
        running = len(self.rows)
        if not self.joining and len(keep) == running:
            return
        kept_running = [i for i in keep if i < running]
        parts, positions = [], []
        if kept_running:
            parts.append(self.running.cache.take_rows(kept_running))
            positions.append(self.running.positions[kept_running])
        for i in keep:
            if i >= running:
                started = self.joining[i - running].started
                parts.append(started.cache)
                positions.append(started.next_pos)
        rows = [(self.rows + self.joining)[i] for i in keep]
        # every row's tokens still to feed fit, or its bound (the bound evicts the rest)
        room = max(r.remaining if r.bound is None else min(r.remaining, r.bound.max_tokens + 1) for r in rows) + 1
        cache = StackedKVCache(parts, room=room, sliding_windows=self.sliding_windows)
        bound = bounded(self.model, cache, [r.bound for r in rows])
        self.running = Decoding(self.model, cache, None, torch.cat(positions), self.step_fn, bound)  # positions (R, 1)
