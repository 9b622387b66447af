"""Read a GGUF file: metadata -> ModelConfig, tensors -> HF-named state dict, tokenizer fields.

Only Gemma 3 is validated (against transformers' own GGUF loader); llama.cpp permutes Llama q/k
weights and we have no Llama GGUF to check an inverse against, so other architectures are refused.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig, RopeConfig

GGUF_ARCHITECTURES = ("gemma3",)

# GGUF tensor name -> HF name; `{i}` is the layer index.
GEMMA3_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading .gguf files needs the `gguf` package: pip install 'structkv[gguf]'") from e
    return gguf


def read_fields(reader) -> dict:
    """GGUF metadata as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def open_gguf(path: str | Path):
    gguf = _import_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated or not a GGUF file
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from e


def gguf_config(fields: dict) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (validated: {', '.join(GGUF_ARCHITECTURES)}); "
            "load a HF safetensors folder instead"
        )
    p = f"{arch}."

    def need(key):
        if key not in fields:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return fields[key]

    n_layers = need(p + "block_count")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    tokens = fields.get("tokenizer.ggml.tokens") or []
    turn_end = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None
    eos_ids = tuple(i for i in (eos, turn_end) if i is not None)
    head_dim = need(p + "attention.key_length")
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=len(tokens),
        hidden_size=need(p + "embedding_length"),
        intermediate_size=need(p + "feed_forward_length"),
        num_layers=n_layers,
        num_heads=need(p + "attention.head_count"),
        num_kv_heads=need(p + "attention.head_count_kv"),
        head_dim=head_dim,
        max_position_embeddings=need(p + "context_length"),
        rms_norm_eps=need(p + "attention.layer_norm_rms_epsilon"),
        # llama.cpp's Gemma 3: every 6th layer is global, local layers use theta 10k.
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)),
        sliding_window=need(p + "attention.sliding_window"),
        rope={"full_attention": RopeConfig(theta=fields.get(p + "rope.freq_base", 1e6)),
              "sliding_attention": RopeConfig(theta=10000.0)},
        qk_norm=True,
        activation="gelu_tanh",
        gemma_norms=True,
        attn_scale=head_dim**-0.5,  # query_pre_attn_scalar = head_dim for Gemma 3 text
        tie_word_embeddings=True,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
    )


def gguf_state_dict(reader, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to `dtype` under its HF name; unknown GGUF names raise."""
    gguf = _import_gguf()
    name_map = {}
    for src, dst in GEMMA3_NAMES.items():
        if "{i}" in src:
            for i in range(cfg.num_layers):
                name_map[src.format(i=i)] = dst.format(i=i)
        else:
            name_map[src] = dst
    unexpected = [t.name for t in reader.tensors if t.name not in name_map]
    if unexpected:
        raise ValueError(f"unexpected tensors in GGUF file: {unexpected[:5]} (of {len(unexpected)})")
    sd = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy())
        if t.name.endswith("norm.weight"):  # GGUF stores Gemma norms as (1 + w)
            w = w - 1.0
        sd[name_map[t.name]] = w.to(dtype)
    return sd
