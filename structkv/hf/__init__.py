"""structkv's methods on Hugging Face transformers models (`pip install 'structkv[hf]'`).

    import structkv.hf
    state = structkv.hf.compress(model, tokenizer, document, "snapkv")   # kv_budget=... etc. as options
    out = structkv.hf.generate(model, tokenizer, "\\nQuestion: ...\\nAnswer:", state=state, max_new_tokens=32)

How: structkv's attention function is registered through transformers' own `AttentionInterface`
(`structkv.hf.attention`: it records each layer's queries, keys and values, then runs
transformers' SDPA attention); each layer's entries are then chosen by the method's own retention
(`Method.retention`, `kv_scores`, `select_tokens`: the code structkv's decoder runs, written once)
and a `DynamicCache` keeps only them. Decoding feeds the model explicit `position_ids` (the
prompt's positions go on after the evicted ones) with `cache_position` over the kept entries, so
RoPE and the mask are what the full prompt would give.

Two kinds of method:
- post-prefill (snapkv, pyramidkv, keydiff, streaming_llm, h2o, ...): the prompt runs once through
  the model's own forward and every layer keeps a subset; the memory saved is the decode's cache,
  not the prefill's peak;
- token pruning between layers (structkv, fastkv, gemfilter): the prompt runs through the model's
  layers one by one (`structkv.hf.pruned`), and past the method's pivot only the kept tokens are
  computed: the prefill saving is real (`HFState.stats`: token-layers computed, seconds).

Supported models: dense decoders (Llama, Mistral without a sliding window, Qwen2, Qwen3). Refused
with a clear error: methods that run extra passes over the model (KVzip) and models with
sliding-window layers (Gemma 3).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..methods import Method, get
from ..methods.base import Layout
from ..modules.view import LayerView
from ..util.timing import clock
from .attention import attach
from .pruned import _decoder, run_pruned

__all__ = ["HFState", "compress", "generate"]


@dataclass
class HFState:
    """A compressed prompt on a transformers model: its `cache` (a `DynamicCache` holding the kept
    entries), the last logits (1, V), the next position, and per layer the kept original positions
    (1, Hkv, K) (`kept`); `stats`: prefill seconds, tokens computed per layer and their share of
    the full prompt's token-layers (`prefill_fraction`, 1.0 for post-prefill methods)."""

    cache: object
    logits: torch.Tensor
    next_position: int
    kept: list
    method: str
    stats: dict | None = None


class _Kept:
    """What a retention stores per layer (the `fill` of structkv's `BudgetedKVCache`)."""

    def __init__(self, num_layers: int):
        self.layers = [None] * num_layers

    def fill(self, layer, k, v, positions, indices, check: bool = True) -> None:
        pos = positions[:, None].expand(-1, k.shape[1], -1)  # (B, Hkv, S)
        if indices is not None:
            if bool((indices < 0).any()):
                raise ValueError("structkv.hf compresses one prompt at a time (no padded rows)")
            k = k.gather(2, indices[..., None].expand(-1, -1, -1, k.shape[-1]))  # (B, Hkv, K, D)
            v = v.gather(2, indices[..., None].expand(-1, -1, -1, v.shape[-1]))
            pos = pos.gather(2, indices)
        self.layers[layer] = (k, v, pos)


def _method(method) -> Method:
    return method if isinstance(method, Method) else get(method)


def _check(model, method: Method) -> None:
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or getattr(cfg, "sliding_window", None) and getattr(
            cfg, "use_sliding_window", True):
        raise ValueError(f"structkv.hf: {cfg.model_type} has sliding-window layers, not supported here yet; "
                         "load it with structkv.load(...) (structkv's own decoder runs every method on it)")
    if type(method.retention({}, _Kept(0))).needs_model:
        raise ValueError(f"structkv.hf: {method.name} chooses its entries with extra passes over the model; run it in "
                         "structkv's decoder (structkv.load)")


def _ids(tokenizer, text, add_special: bool) -> list[int]:
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("structkv.hf: give a tokenizer for text, or pass token ids")
        return tokenizer(text, add_special_tokens=add_special)["input_ids"]
    ids = list(text)
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError("structkv.hf: a prompt is text or a non-empty list of token ids")
    return ids


@torch.inference_mode()
def compress(model, tokenizer, context, method="snapkv", **options) -> HFState:
    """Run `context` (text or token ids) through `model` once and keep what `method` (a structkv
    method or its registered name, with `options` such as kv_budget=0.2) keeps of every layer; a
    method that prunes tokens between layers computes only its kept tokens past its pivot."""
    method = _method(method) if not options else get(method, **options)
    ids = _ids(tokenizer, context, add_special=True)
    L = model.config.num_hidden_layers
    layout = Layout(L, list(range(L)))
    lengths = torch.tensor([len(ids)])
    _check(model, method)
    capture = getattr(model, "_structkv_capture", None) or attach(model)
    model._structkv_capture = capture
    tokens = torch.tensor([ids], device=model.device)
    kept = _Kept(L)
    prop = method.propagation(layout, lengths)
    if prop is not None:
        prop.begin(len(ids), model.device)
    retention = method.retention(method.kv_plan(layout, lengths), kept)
    if prop is None:
        return _post_prefill(model, capture, tokens, method, retention, kept)
    run = run_pruned(model, capture, tokens, prop, retention)
    computed = sum(run["tokens_per_layer"])
    if run["restart"] is not None:  # GemFilter: the kept tokens re-encoded, uncompressed
        ids2, pos2 = run["restart"]
        t0 = clock()
        out = model(input_ids=ids2, position_ids=pos2, use_cache=True, logits_to_keep=1)
        n = ids2.shape[1]
        stats = {"prefill_s": run["prefill_s"] + clock() - t0, "tokens_per_layer": run["tokens_per_layer"] + [n] * L,
                 "prefill_fraction": (computed + n * L) / (len(ids) * L)}
        cache = _out_cache(out)
        kept_pos = [pos2[:, None].expand(-1, layer.keys.shape[1], -1) for layer in cache.layers]
        return HFState(cache, out.logits[:, -1].float(), int(pos2.max()) + 1, kept_pos, method.name,
                       stats)
    stats = {"prefill_s": run["prefill_s"], "tokens_per_layer": run["tokens_per_layer"],
             "prefill_fraction": computed / (len(ids) * L)}
    return HFState(_dynamic_cache(model, kept), run["logits"], run["next_position"], [p for _, _, p in kept.layers],
                   method.name, stats)


def _inv_freq(model) -> torch.Tensor | None:
    """The RoPE frequencies (D/2,) of the model's rotary embedding, scaling included (Expected
    Attention turns its query statistics by them); None where the model keeps none."""
    freq = getattr(getattr(_decoder(model), "rotary_emb", None), "inv_freq", None)
    return None if freq is None else freq.float()


def _post_prefill(model, capture, tokens, method: Method, retention, kept: _Kept) -> HFState:
    """The model's own forward once, then every layer's kept subset of its entries."""
    t0, (_, S) = clock(), tokens.shape
    positions = torch.arange(S, device=model.device)[None]  # (1, S)
    inv_freq = _inv_freq(model)

    def score(i, q, k, v, scale):  # each layer as its attention runs: its queries go at once
        retention.layer(LayerView(i, q, k, v, positions, positions, scale, lengths=[S], inv_freq=inv_freq))
        retention.after_propagation(None)

    def trim(i, cache):  # the layer's entries cut to the kept ones as soon as they are chosen
        if kept.layers[i] is not None and i < len(cache.layers):
            cache.layers[i].keys, cache.layers[i].values = (t.contiguous() for t in kept.layers[i][:2])
    capture.on, capture.layers, capture.sink, capture.trim = True, {}, score, trim
    try:
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1)  # the last logits only, as the pruned loop
    finally:
        capture.on, capture.sink, capture.trim = False, None, None
    retention.finish(None, tokens, {})
    cache = _out_cache(out)
    for i in range(len(kept.layers)):  # the layers the hook could not cut (a retention that stores late)
        trim(i, cache)
    stats = {"prefill_s": clock() - t0, "tokens_per_layer": [S] * len(kept.layers), "prefill_fraction": 1.0}
    return HFState(cache, out.logits[:, -1].float(), S, [p for _, _, p in kept.layers], method.name, stats)


def _dynamic_cache(model, kept: _Kept):
    """A transformers `DynamicCache` holding each layer's kept entries (B, Hkv, K, D)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v, _) in enumerate(kept.layers):
        cache.update(k.contiguous(), v.contiguous(), i)
    return cache


def _out_cache(out):
    """The cache a transformers forward returned (`cache` from 5.2x, `past_key_values` before)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _cache_arg(model) -> str:
    """The name transformers' forward takes the cache by ("cache" from 5.2x, "past_key_values" before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _feed(model, cache, ids: list[int], position: int):
    """Append `ids` at original positions `position`.. to `cache`; the last logits (1, V). Layers
    that keep different numbers of entries (PyramidKV) take one token at a time: transformers
    builds one mask for every layer, and a single query needs none."""
    if len(ids) > 1 and len({layer.keys.shape[-2] for layer in cache.layers}) > 1:
        for i, token in enumerate(ids):
            logits = _feed(model, cache, [token], position + i)
        return logits
    n = len(ids)
    used = cache.get_seq_length()
    out = model(input_ids=torch.tensor([ids], device=model.device), **{_cache_arg(model): cache}, use_cache=True,
                position_ids=torch.arange(position, position + n, device=model.device)[None],
                cache_position=torch.arange(used, used + n, device=model.device))
    return out.logits[:, -1].float()


@torch.inference_mode()
def generate(model, tokenizer, prompt=None, *, state: HFState | None = None, method=None, max_new_tokens: int = 64,
             stop_at_eos: bool = True) -> dict:
    """Greedy continuation: of `prompt` compressed by `method` (no `state`), or of `state` with
    `prompt` (a question; may be None) appended uncompressed on a copy of its cache. Returns
    {"text", "token_ids"}; the state is not modified."""
    if state is None:
        if prompt is None:
            raise ValueError("structkv.hf.generate: give a prompt, a state, or both")
        state = compress(model, tokenizer, prompt, method or "snapkv")
        prompt = None
    elif method is not None:
        raise ValueError("structkv.hf.generate: pass either method= (compress the prompt) or state=, not both")
    cache = copy.deepcopy(state.cache)
    logits, position = state.logits, state.next_position
    if prompt is not None:
        ids = _ids(tokenizer, prompt, add_special=False)
        logits = _feed(model, cache, ids, position)
        position += len(ids)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) if stop_at_eos else None
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    out = []
    for step in range(max_new_tokens):
        token = int(logits.argmax(-1))
        if token in eos:
            break
        out.append(token)
        if step < max_new_tokens - 1:
            logits = _feed(model, cache, [token], position)
            position += 1
    text = tokenizer.decode(out) if tokenizer is not None else None
    return {"text": text, "token_ids": out}
