"""The layer loop for methods that prune tokens between layers (StructKV, FastKV, GemFilter) on a
transformers model: their prefill saving, not only their eviction.

Why a loop of our own: such a method decides after layer r which tokens go on, and the layers past
r must then compute on fewer tokens; transformers' `Model.forward` runs every layer on the whole
sequence. transformers exposes the pieces of its loop (`embed_tokens`, `rotary_emb`, `layers`,
`norm`, `lm_head`), so this module runs them in order itself, with nothing of transformers
patched: after each layer the captured queries and keys (`structkv.hf.attention`) go to the
method's propagation and retention (`structkv.runtime.compress.layer_steps`, the per-layer
sequence structkv's decoder runs), and when the propagation fires the hidden states and their
original positions are gathered (`SkeletonPruner.gather`). The kept tokens stay in prompt order,
so the causal mask of the shorter sequence is the full prompt's mask restricted to them and SDPA's
`is_causal` is exact; RoPE takes their original positions. A propagation that restarts (GemFilter)
re-encodes the prompt it gives through the whole model, as structkv's decoder does.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..modules.view import LayerView
from ..runtime.compress import layer_steps
from ..util.timing import clock


def _decoder(model):
    """The transformers model's decoder (the part holding `layers`, `norm`, `rotary_emb`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("embed_tokens", "rotary_emb", "layers", "norm"):
        if not hasattr(base, name):
            raise ValueError(f"structkv.hf: {type(base).__name__} has no `{name}`; token pruning between layers "
                             "supports the Llama, Mistral, Qwen2 and Qwen3 decoders")
    return base


def run_pruned(model, capture, tokens: torch.Tensor, prop, retention) -> dict:
    """Prefill `tokens` (1, S) layer by layer, pruning where `prop` fires; `retention` fills the
    kept entries of every layer. Returns {"logits" (1, V), "next_position", "tokens_per_layer",
    "restart" (the re-encoded (ids, positions) or None), "prefill_s"}."""
    t0 = clock()
    base = _decoder(model)
    S = tokens.shape[1]
    h = base.embed_tokens(tokens)  # (1, S, E)
    positions = torch.arange(S, device=tokens.device)[None]  # (1, S) original positions
    columns = positions.clone()  # (1, S) prompt columns
    member = SimpleNamespace(store=retention)
    processed = []
    for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
        processed.append(h.shape[1])
        capture.on, capture.layers = True, {}
        try:
            h = layer(h, attention_mask=None, position_ids=positions,
                      position_embeddings=base.rotary_emb(h, positions), use_cache=False)
        finally:
            capture.on = False
        q, k, v, scale = capture.layers.pop(i)
        view = LayerView(i, q, k, v, positions, columns, scale, lengths=[h.shape[1]])
        kept = layer_steps([member], prop, view)
        if kept is None:
            continue
        if bool((kept < 0).any()):
            raise ValueError("structkv.hf compresses one prompt at a time (no padded rows)")
        if prop.restart:
            ids, new_pos, _ = prop.restart_prompt(tokens, view, kept)
            return {"restart": (ids, new_pos), "tokens_per_layer": processed, "prefill_s": clock() - t0}
        h, columns, positions = prop.pruner.gather(kept, h, columns, positions=positions)
    retention.finish(None, tokens, {})
    logits = model.lm_head(base.norm(h[:, -1:]))[:, -1].float()  # (1, V) after the prompt's last kept token
    return {"logits": logits, "next_position": int(positions.max()) + 1, "tokens_per_layer": processed, "restart": None,
            "prefill_s": clock() - t0}
