"""The attention function structkv registers with transformers: it sees each layer's queries.

Why here: a post-prefill method scores the prompt's keys by its last queries (SnapKV's window,
H2O's received attention), and a transformers model computes its queries inside the attention
module. transformers' own extension point for attention (`AttentionInterface.register`) hands a
registered function every layer's query, key and value after RoPE, so nothing of transformers is
patched: the function records what the method needs (`Capture`) and then runs transformers' own
SDPA attention, so the model's outputs are exactly what "sdpa" gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NAME = "structkv"


@dataclass
class Capture:
    """Per layer index: (q (B, Hq, S, D), k, v (B, Hkv, S, D), scale) of the last prefill call.
    `sink`, when set, takes (layer, q, k, v, scale) at once instead: a post-prefill method scores
    each layer while the forward runs, so no layer's queries outlive its attention (kvpress's
    hooks do the same)."""

    layers: dict = field(default_factory=dict)
    on: bool = False
    sink: object = None
    trim: object = None  # (layer, cache) after a layer's attention: its cache entries cut to the kept


def register():
    """Register the attention function and its mask under `NAME` (once per process; idempotent)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("structkv.hf needs transformers >= 5: pip install 'structkv[hf]'") from e
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        capture = getattr(module, "_structkv_capture", None)
        if capture is not None and capture.on:
            entry = (query, key, value, scaling if scaling is not None else module.scaling)
            if capture.sink is not None:
                capture.sink(module.layer_idx, *entry)
            else:
                capture.layers[module.layer_idx] = entry
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attach(model) -> Capture:
    """Point `model`'s attention at the registered function and give every attention module one
    shared `Capture` (an attribute on the module, read by the function)."""
    register()
    capture = Capture()
    model.set_attn_implementation(NAME)
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            if not hasattr(module, "_structkv_capture"):
                module.register_forward_hook(_after_attention, with_kwargs=True)
            module._structkv_capture = capture
    return capture


def _after_attention(module, args, kwargs, output):
    """A forward hook (torch's, on the attention module): once a layer's attention has run, the
    capture's `trim` may cut that layer's cache to its kept entries, so the whole prompt's K/V of
    every layer never sit in memory at once (the cache comes as the module's `cache` argument,
    `past_key_values` before transformers 5.2x)."""
    capture = module._structkv_capture
    if capture.on and capture.trim is not None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            capture.trim(module.layer_idx, cache)


