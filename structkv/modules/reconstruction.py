"""Context-reconstruction scores (KVzip): how much the model needs each KV entry to repeat its context.

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
from types import SimpleNamespace

import torch

from ..models.kv_cache import LayerKVCache
from ..ops import visible

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
