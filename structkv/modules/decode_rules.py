"""Decode-time eviction rules: how a KV bound (`structkv.modules.decode_bound`) ranks a layer's
entries when a row must evict. One small class per rule, registered by name in `RULES` (what
`DecodeBound(rule=...)`, `generate(max_kv_tokens=...)` and the command line's `--decode-evict`
accept); a rule of your own is a subclass passed to `register`.

A rule says whether the bound must keep each layer's recent decode queries for it
(`needs_queries`) and whether it folds their attention into the carried centrality (`carries`),
and scores entries: `scores(layer, index, pos)` -> (R, Hkv, C), higher stays. Until the first
decode query is kept, the query-based rules rank by `unrepeated` alone.

Shapes: R rows being evicted, Hkv KV heads, C slots, D head dim, n kept queries, G = Hq // Hkv.
"""
from __future__ import annotations

from typing import ClassVar

import torch

NOVELTY_CHUNK = 1024  # keys whose similarities to every other key are held at once


class DecodeRule:
    """One rule: `scores` ranks a layer's entries (higher stays); the flags say what the bound
    keeps for it while decoding."""

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = True  # the layers keep their last decode queries
    carries: ClassVar[bool] = False  # the queries' attention is folded into the carried centrality

    def scores(self, layer, index: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Window(DecodeRule):
    """SnapKV on generated tokens: the attention the last decode queries gave each entry, summed
    over the query heads of its KV head."""

    name = "window"

    def scores(self, layer, index, pos):
        k = _keys(layer, index)
        attention = window_attention(layer, index, k, pos)
        return unrepeated(k, pos) if attention is None else attention


class Redundancy(DecodeRule):
    """R-KV's idea: the same attention blended half and half with `unrepeated`, so of two keys that
    repeat each other the older one goes first (a reasoning trace repeats itself)."""

    name = "redundancy"

    def scores(self, layer, index, pos):
        k = _keys(layer, index)
        novelty = unrepeated(k, pos)
        attention = window_attention(layer, index, k, pos)
        if attention is None:
            return novelty
        top = attention.amax(-1, keepdim=True).clamp_min(1e-30)
        return 0.5 * attention / top + 0.5 * novelty / 2


class Recent(DecodeRule):
    """StreamingLLM: the sinks and the most recent entries, no scoring at all."""

    name = "recent"
    needs_queries = False

    def scores(self, layer, index, pos):
        return pos.float()


class Centrality(DecodeRule):
    """StructKV's centrality carried forward: an entry's score is its position's carried C, shared
    by the layer's heads; `unrepeated` while some head's table is still empty."""

    name = "centrality"
    carries = True

    def scores(self, layer, index, pos):
        carried = layer.carried.index_select(0, index).gather(1, pos.clamp_min(0).flatten(1)).view_as(pos)
        if bool((carried > 0).any(-1).all()):  # (R, Hkv, C): each entry's position's score
            return carried
        return unrepeated(_keys(layer, index), pos)


RULES: dict[str, DecodeRule] = {}


def register(rule: DecodeRule) -> DecodeRule:
    """Add a rule (an instance of a `DecodeRule` subclass) under its `name`."""
    if not isinstance(rule, DecodeRule) or not getattr(rule, "name", None):
        raise TypeError(f"a decode rule is a named DecodeRule instance, got {rule!r}")
    RULES[rule.name] = rule
    return rule


for _rule in (Window(), Redundancy(), Recent(), Centrality()):
    register(_rule)


def _keys(layer, index: torch.Tensor) -> torch.Tensor:
    return layer.read(torch.float32)[0].index_select(0, index).float()  # (R, Hkv, C, D)


def unrepeated(k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """1 - the largest cosine similarity of each key to a later entry of its head (R, Hkv, C), in
    [0, 2]; 1 for the latest. (Prefill's `scores.key_novelty` is another measure: a key against
    its layer's average key.)"""
    unit = torch.nn.functional.normalize(k, dim=-1)
    best = []
    for s in range(0, k.shape[2], NOVELTY_CHUNK):  # (R, Hkv, c, C) similarities at a time, not (C, C)
        sim = unit[:, :, s:s + NOVELTY_CHUNK] @ unit.transpose(-1, -2)  # (R, Hkv, c, C)
        p = pos[:, :, s:s + NOVELTY_CHUNK, None]
        later = (pos[:, :, None, :] > p) & (pos[:, :, None, :] >= 0)  # j after i
        best.append(sim.masked_fill_(~later, float("-inf")).amax(-1))
    best = torch.cat(best, -1)  # (R, Hkv, C)
    return 1 - torch.where(torch.isfinite(best), best, torch.zeros_like(best))


def window_attention(layer, index: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
    """The attention the kept decode queries gave each entry, summed over queries and the query
    heads of its KV head (R, Hkv, C); None before any query was kept."""
    if not layer.query_slots:
        return None
    q_pos = layer.q_pos.index_select(0, index)  # (R, n)
    if not bool((q_pos >= 0).any()):
        return None
    return query_attention(layer, index, k, pos, q_pos)


def query_attention(layer, index: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, q_pos: torch.Tensor):
    """The attention the kept queries at `q_pos` (R, n; -1: not counted) gave each entry, summed
    over those queries and the query heads of its KV head (R, Hkv, C)."""
    q = layer.q_recent.index_select(0, index)  # (R, Hq, n, D), scaled
    R, Hq, n, D = q.shape
    Hkv = k.shape[1]
    logits = q.reshape(R, Hkv, Hq // Hkv, n, D) @ k[:, :, None].transpose(-1, -2)  # (R, Hkv, G, n, C)
    seen = (pos[:, :, None, None, :] >= 0) & (q_pos[:, None, None, :, None] >= 0) \
        & (pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    if layer.sliding_window is not None:
        seen &= pos[:, :, None, None, :] > q_pos[:, None, None, :, None] - layer.sliding_window
    p = torch.nan_to_num(logits.masked_fill(~seen, float("-inf")).softmax(-1), nan=0.0)
    return p.sum(dim=(2, 3))  # (R, Hkv, C)
