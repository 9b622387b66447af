"""KVzip (Kim et al. 2025): each entry kept by how much the model needs it to repeat its context.

Everything of the method is here: its options (`KVzip`), its retention (the planned layers'
entries held through the prefill, then scored at once: `ReconstructionRetention`, the loop's
`finish` hook) and the reconstruction scores themselves.

Context-reconstruction scores (KVzip): how much the model needs each KV entry to repeat its context.

After the prompt's full prefill, the model is asked to repeat the context: a reconstruction
prompt ("Repeat the previous context exactly:") followed by the context itself is fed on top of
the full cache, one chunk of the context at a time (each chunk on the original cache, so memory
stays bounded by one chunk). A context entry's score at a layer is the largest attention
probability any reconstruction query of any head in its KV group gives it. An entry no query
needs to reproduce the context is one no later question can need either: the scores do not
depend on a question, which is what compress-once-ask-many needs.

Shapes: B batch (one row at a time here), Hq / Hkv query / KV heads, G = Hq // Hkv, n context
tokens, S tokens of a chunk (prompt included), D head dim.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..models.kv_cache import LayerKVCache, round_capacity
from ..modules.retention import Retention, _Held
from ..ops import visible
from ..text import chat
from .base import Method

DEFAULT_PROMPT = "\n\nRepeat the previous context exactly.\n"
# kvpress's KVzipPress (the peer): its first chunk's prompt, and for later chunks one that names
# where to start: the previous chunk's last `CONTINUE_TOKENS` tokens
KVPRESS_PROMPT = "\n\nRepeat the previous context exactly."
KVPRESS_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"
CONTINUE_TOKENS = 8


def reconstruction_scores(model, held: dict, rings: dict, tokens: torch.Tensor, prompt_ids,
                          chunk: int, local: bool = False, start_at: int = 0) -> tuple[dict, int, float]:
    """Scores (1, Hkv, n) per planned layer for one row.

    held: layer -> (k, v, positions) of the row's context, k/v (1, Hkv, n, D), positions (1, n)
    (the layers whose entries are chosen); rings: layer -> that layer's `LayerKVCache` (every other
    layer, e.g. sliding-window rings, as the compressed cache holds it); tokens (n,) the context's
    token ids in order. `prompt_ids`: the ids before each chunk, or a function (chunk number,
    previous chunk's ids) -> them. `local`: each chunk's softmax over its own span of the context
    (and the first `LOCAL_SINKS` tokens) instead of the whole context, as kvpress's KVzipPress
    scores; `start_at`: context tokens before this one (a chat template's head) are not repeated.
    Returns (scores, reconstruction tokens run, seconds).
    """
    t0 = time.perf_counter()
    positions = next(iter(held.values()))[2]  # (1, n)
    start = int(positions.max()) + 1
    prompt_of = prompt_ids if callable(prompt_ids) else (lambda i, prev: prompt_ids)
    longest = max(len(prompt_of(i, [0] * chunk)) for i in (0, 1))
    caches, sizes = _cache(model, held, rings, longest + chunk)
    scores = {i: torch.zeros(k.shape[:3], device=k.device) for i, (k, _, _) in held.items()}  # (1, Hkv, n)
    run = 0
    for number, s in enumerate(range(start_at, tokens.shape[0], chunk)):
        previous = tokens[max(start_at, s - chunk):s]
        ids = torch.tensor(prompt_of(number, previous.tolist()), dtype=torch.long, device=tokens.device)
        ids = torch.cat([ids, tokens[s:s + chunk]])[None]  # (1, S)
        span = (s, min(s + chunk, tokens.shape[0])) if local else None
        pos = start + torch.arange(ids.shape[1], device=tokens.device)[None]  # (1, S): right after the context
        saved = [{name: b.clone() for name, b in layer.named_buffers()} for layer in rings.values()]

        def on_layer(i, h, p, q, k, v):
            if i in scores:
                scores[i] = torch.maximum(scores[i], _received(q, caches.layers[i], sizes[i], k, p, model, span))

        model(ids, pos, cache=caches, on_layer=on_layer, last=True)
        run += ids.shape[1]
        for i, layer in held.items():  # forget the chunk: back to the context alone
            caches.layers[i].cursor.fill_(sizes[i])
            caches.layers[i].pos[:, :, sizes[i]:] = -1
        for layer, saved_buffers in zip(rings.values(), saved):
            for name, buf in layer.named_buffers():
                buf.copy_(saved_buffers[name])
    return scores, run, time.perf_counter() - t0


def _cache(model, held: dict, rings: dict, room: int):
    """A cache object over every layer: the held context (with `room` free slots for a chunk) and
    the given ring layers. Returns it and the context size of each held layer."""
    layers, sizes = [], {}
    for i in range(model.config.num_layers):
        if i in held:
            k, v, pos = held[i]
            cache = LayerKVCache(1, k.shape[1], k.shape[2] + room, k.shape[3], k.dtype, k.device)
            cache.fill(k, v, pos)
            sizes[i] = k.shape[2]
            layers.append(cache)
        else:
            layers.append(rings[i])
    return SimpleNamespace(layers=layers), sizes


LOCAL_SINKS = 4  # with a local span, the first tokens stay in every chunk's softmax (kvpress's n_sink)


def _received(q, cache: LayerKVCache, n: int, k_new, q_pos, model, span=None) -> torch.Tensor:
    """Largest attention probability each of the n context entries gets from the chunk's queries:
    (1, Hkv, n), max over the queries and the G query heads of each KV head; the softmax runs over
    the context and the chunk's own (causal) keys, as the model's attention does, or, with `span`
    (start, end) context indices, over the first `LOCAL_SINKS`, that span and the chunk's own keys
    (entries outside get 0)."""
    B, Hq, S, D = q.shape
    Hkv = cache.k.shape[1]
    scale = model.config.scale
    qg = q.float().reshape(B, Hkv, Hq // Hkv, S, D)  # (1, Hkv, G, S, D)
    keys = torch.cat([cache.k[:, :, :n], k_new], 2).float()  # (1, Hkv, n + S, D)
    k_pos = torch.cat([cache.pos[:, :, :n], q_pos[:, None].expand(-1, Hkv, -1)], 2)  # (1, Hkv, n + S)
    logits = torch.matmul(qg, keys[:, :, None].transpose(-1, -2)) * scale  # (1, Hkv, G, S, n + S)
    mask = visible(q_pos, k_pos, None)[:, :, None]  # (1, Hkv, 1, S, n + S)
    if span is not None:
        index = torch.arange(n + S, device=q.device)
        inside = (index < LOCAL_SINKS) | ((index >= span[0]) & (index < span[1])) | (index >= n)  # (n + S,)
        mask = mask & inside
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, -1)[..., :n]  # (1, Hkv, G, S, n)
    return probs.amax(dim=(2, 3))  # (1, Hkv, n)


@dataclass
class KVzip(Method):
    """Query-agnostic: each entry kept by how much the model needs it to repeat its context (KVzip,
    Kim et al. 2025). After the full prefill the context is fed again, chunk by chunk, after a
    "repeat the previous context" prompt; an entry's score is the largest attention any
    reconstruction query gives it (max over its KV group's heads). Costs about one more prefill.

    chunk: context tokens per reconstruction pass (memory is bounded by one chunk); prompt: the
    reconstruction instruction (empty for a model without a tokenizer).
    What kvpress's KVzipPress does differently, each an option (`kvzip_kvpress` takes them all):
    chat_turn: on a model with a chat template, the prompt closes the user turn and opens the
    assistant's before the repeated chunk (and the template's head is not repeated); local: each
    chunk's softmax over its own span of the context (and the first tokens), not the whole
    context; continued: later chunks are asked to repeat "starting with" the previous chunk's
    last tokens; sinks: the first tokens always kept; budget: "layer" (each layer and KV head keeps
    kv_budget) or "global" (one threshold over every layer and head, the same total: kvpress's
    default allocation)."""

    kv_budget: float | int = 0.1
    window: int = 8
    chunk: int = 512
    prompt: str = DEFAULT_PROMPT
    per_head: bool = True
    chat_turn: bool = False
    local: bool = False
    continued: bool = False
    sinks: int = 0
    budget: str = "layer"
    name = "kvzip"
    compresses_kv = True

    def retention(self, plan, cache):
        return ReconstructionRetention(self, plan, cache)

    def validate(self):
        super().validate()
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"kvzip: chunk must be a positive int (context tokens per reconstruction pass), "
                             f"got {self.chunk!r}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"kvzip: prompt must be text, got {self.prompt!r}")
        for name in ("chat_turn", "local", "continued"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kvzip: {name} must be True or False, got {getattr(self, name)!r}")
        if self.budget not in ("layer", "global"):
            raise ValueError(f"kvzip: budget must be 'layer' (per layer and head) or 'global' (one threshold over "
                             f"every layer and head), got {self.budget!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"kvzip: sinks must be an int >= 0 (first tokens always kept), got {self.sinks!r}")


class ReconstructionRetention(Retention):
    """KVzip's retention: every planned layer's entries are held through the prefill, then scored
    by context reconstruction (`reconstruction_scores` below) and selected at once. Extra
    memory during the prefill only (the final cache has the planned size); the reconstruction
    costs about one more prefill, reported as the retention's `extra_pass` (tokens run, seconds)."""

    needs_model = True

    def __init__(self, method, plan: dict, cache):
        super().__init__(method, plan, cache)
        self.held: list[_Held] = []

    def layer(self, view) -> None:
        if view.layer in self.plan:
            self.held.append(_Held(view, None))
            return
        super().layer(view)

    def finish(self, model=None, tokens=None, memo: dict | None = None) -> None:
        if not self.held:
            return
        if model is None:
            raise ValueError("kvzip scores its entries by running the model again: the prefill loop passes it")
        m = self.method
        key = ("reconstruction", m.prompt, m.chunk, m.chat_turn, m.local, m.continued, m.sinks)
        memo = {} if memo is None else memo
        if key not in memo:  # the same context and K/V for every method of the lane: run it once
            memo[key] = self._score(model, tokens)
        scores, run, seconds = memo[key]
        if m.budget == "global":
            self._store_global(scores, getattr(model, "tp", None))
        else:
            for held in self.held:
                held.scores = self.method.heads(scores[held.layer])
                self._store(held)
        self.held = []
        self.extra_pass = {"tokens": run, "seconds": seconds}

    def _store_global(self, scores: dict, tp=None) -> None:
        """kvpress's allocation: one threshold per row over every held layer and KV head, so the
        layers' and heads' shares follow their scores; the total kept is the per-layer plan's. A
        layer whose heads now keep more than its plan gets a larger cache layer (same room). Under
        tensor parallelism the threshold is taken over every rank's heads (the same on all ranks)."""
        first = self.held[0]
        B, H = first.k.shape[:2]
        ranked = {}
        for held in self.held:  # the window always stays, as in every selection
            sc = scores[held.layer].clone()
            n = sc.shape[-1]
            sc[..., n - self.method.window:] = 3.0
            ranked[held.layer] = sc.masked_fill(~held.valid[:, None], float("-inf"))  # (B, Hkv, n)
        every = {i: tp.gather_heads(x) if tp is not None else x for i, x in ranked.items()}  # (B, all Hkv, n)
        for b in range(B):
            total = sum(self.plan[h.layer][b] for h in self.held) * every[first.layer].shape[1]
            pool = torch.cat([every[h.layer][b].flatten() for h in self.held])
            cut = pool.topk(min(total, pool.numel())).values[-1]
            for h in self.held:
                ranked[h.layer][b] = torch.where(ranked[h.layer][b] >= cut, ranked[h.layer][b], float("-inf"))
                every[h.layer][b] = torch.where(every[h.layer][b] >= cut, every[h.layer][b], float("-inf"))
        for held in self.held:
            keep = ranked[held.layer] > float("-inf")  # (B, Hkv, n)
            M = int((every[held.layer] > float("-inf")).sum(-1).max())  # over every rank's heads: one layout
            order = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :M]
            idx = torch.where(keep.gather(2, order), order, torch.full_like(order, -1)).sort(-1).values  # -1 first
            old = self.cache.layers[held.layer]
            room = old.capacity - max(self.plan[held.layer])
            if M + room > old.capacity:
                self.cache.layers[held.layer] = LayerKVCache(B, H, round_capacity(M + room), old.head_dim, old.k.dtype,
                                                             old.pos.device, kv_dtype=old.kv_dtype)
            with held.timer.phase("cache_fill"):
                self.cache.fill(held.layer, held.k, held.v, held.positions, idx, check=False)

    def _score(self, model, tokens: torch.Tensor):
        """Scores (B, Hkv, n) per held layer, one row at a time (each row's own context, unpadded)."""
        prompt_ids, head = _reconstruction_prompt(model.tokenizer, self.method)
        first = self.held[0]
        out = {h.layer: torch.zeros(h.k.shape[:3], device=h.k.device) for h in self.held}  # (B, Hkv, n)
        run = seconds = 0
        room = max(len(prompt_ids(i, [0] * self.method.chunk)) for i in (0, 1)) + self.method.chunk
        for b in range(first.valid.shape[0]):
            cols = first.valid[b].nonzero()[:, 0]  # this row's tokens (no propagation: the same at every layer)
            held = {h.layer: (h.k[b:b + 1, :, cols], h.v[b:b + 1, :, cols], h.positions[b:b + 1, cols])
                    for h in self.held}
            row = tokens[b, first.columns[b, cols]]
            rings = {i: _row(layer, b, room) for i, layer in enumerate(self.cache.layers) if i not in held}
            start_at = len(head) if head and row[:len(head)].tolist() == head else 0  # the head: not repeated
            scores, r, s = reconstruction_scores(model, held, rings, row, prompt_ids, self.method.chunk,
                                                 local=self.method.local, start_at=start_at)
            for i, sc in scores.items():
                sc[..., :self.method.sinks] = 2.0  # above any probability: the first tokens always stay
                out[i][b:b + 1, :, cols] = sc
            run, seconds = run + r, seconds + s
        return out, run, seconds


def _row(layer, b: int, room: int):
    """A one-row copy of a cache layer with `room` free slots after its entries (a ring stays its
    window): the reconstruction writes a chunk into it, then restores it."""
    used = layer.capacity if layer.sliding_window is not None else int(layer.cursor)
    out = LayerKVCache(1, layer.k.shape[1], used + room, layer.head_dim, layer.k.dtype, layer.k.device,
                       sliding_window=layer.sliding_window, kv_dtype=layer.kv_dtype)
    for name in (*layer.planes, "pos"):
        getattr(out, name)[:, :, :used] = getattr(layer, name)[b:b + 1, :, :used]
    out.cursor.copy_(layer.cursor)
    return out


def _reconstruction_prompt(tokenizer, method):
    """(chunk number, previous chunk's ids) -> the ids before a chunk, and the chat template's head
    ids (what a context inside a user turn starts with; [] when the prompt is not a chat turn).

    `chat_turn`: the prompt closes the user turn and opens the assistant's (the template's tail)
    before the repeated chunk, so the repetition is the assistant's answer, as kvpress does for
    models with a template; `continued`: chunks after the first are asked to repeat "starting
    with" the previous chunk's last tokens (kvpress's prompt)."""
    if tokenizer is None:
        return (lambda i, prev: []), []
    base = tokenizer.encode(method.prompt, add_bos=False)
    head, tail = [], []
    if method.chat_turn and getattr(tokenizer, "chat_template", None):
        head, tail = chat.frame(tokenizer)
    again = tokenizer.encode(KVPRESS_CONTINUE, add_bos=False) if method.continued else base

    def prompt(i: int, previous: list[int]) -> list[int]:
        if i == 0 or not method.continued:
            return base + tail
        return again + previous[-CONTINUE_TOKENS:] + tail
    return prompt, head
