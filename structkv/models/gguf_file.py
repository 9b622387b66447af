"""Read a GGUF file: metadata -> ModelConfig, tensors -> HF-named state dict, tokenizer fields.

Architectures: Gemma 3 and the llama family (llama, mistral, qwen2, qwen3), validated against
transformers' own GGUF loader (Gemma 3 270M, SmolLM2-135M) and against GGUF files written in the
tests. llama.cpp's converter interleaves the two rotary halves of each head in the q and k rows of
llama and mistral models; `unpermute` undoes it, so the weights fit HF's `rotate_half` RoPE.
Every quantisation type the `gguf` package can dequantise is read (to float32).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..text.tokenizer import TURN_ENDS
from .architectures import gguf_architecture, global_pattern
from .config import ModelConfig, RopeConfig

# GGUF tensor name -> HF name for the llama family; `{i}` is the layer index.
LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",  # qwen2
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # qwen3
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

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


def gguf_config(fields: dict, tensor_names: list[str] | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (`tensor_names` tells whether the LM head is tied)."""
    arch = gguf_architecture(fields.get("general.architecture"))
    p = f"{arch.gguf}."

    def need(key):
        if key not in fields:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return fields[key]

    tokens = fields.get("tokenizer.ggml.tokens") or []
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, *(tokens.index(t) for t in TURN_ENDS if t in tokens))
                                  if i is not None))
    n_layers, n_heads, hidden = need(p + "block_count"), need(p + "attention.head_count"), need(p + "embedding_length")
    common = dict(
        vocab_size=len(tokens) or need(p + "vocab_size"), hidden_size=hidden,
        intermediate_size=need(p + "feed_forward_length"), num_layers=n_layers, num_heads=n_heads,
        num_kv_heads=fields.get(p + "attention.head_count_kv", n_heads),
        max_position_embeddings=need(p + "context_length"), rms_norm_eps=need(p + "attention.layer_norm_rms_epsilon"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos_ids,
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
    )
    common.update(model_type=arch.model_type, qk_norm=arch.qk_norm, attention_bias=arch.attention_bias,
                  activation=arch.activation, gemma_norms=arch.gemma_norms)
    if arch.global_every:  # llama.cpp's Gemma 3: the table's layer pattern, local layers at the table's theta
        head_dim = need(p + "attention.key_length")
        return ModelConfig(
            head_dim=head_dim, **common,
            layer_types=global_pattern(arch, n_layers),
            sliding_window=need(p + "attention.sliding_window"),
            rope={"full_attention": RopeConfig(theta=fields.get(p + "rope.freq_base", 1e6)),
                  "sliding_attention": RopeConfig(theta=arch.local_theta)},
            attn_scale=head_dim**-0.5,  # query_pre_attn_scalar = head_dim for Gemma 3 text
            tie_word_embeddings=arch.tied_embeddings,
        )
    return ModelConfig(
        head_dim=fields.get(p + "attention.key_length") or hidden // n_heads, **common,
        layer_types=("full_attention",) * n_layers, rope=_llama_rope(fields, p),
        tie_word_embeddings=tensor_names is not None and "output.weight" not in tensor_names,
    )


def _llama_rope(fields: dict, p: str) -> dict:
    kind = fields.get(p + "rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (none, linear); load a HF folder instead")
    rope = RopeConfig(theta=float(fields.get(p + "rope.freq_base", 10000.0)),
                      rope_type="linear" if kind == "linear" else "default",
                      factor=float(fields.get(p + "rope.scaling.factor", 1.0)))
    return {"full_attention": rope, "sliding_attention": rope}


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, rows were reordered from HF's
    (first half, second half) of the head dimension to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_names(cfg: ModelConfig, arch: str) -> dict[str, str]:
    """GGUF tensor name -> HF name for every layer of `cfg`."""
    names = GEMMA3_NAMES if gguf_architecture(arch).gemma_norms else LLAMA_NAMES
    name_map = {}
    for src, dst in names.items():
        if "{i}" in src:
            for i in range(cfg.num_layers):
                name_map[src.format(i=i)] = dst.format(i=i)
        else:
            name_map[src] = dst
    return name_map


def tensor_types(reader, cfg: ModelConfig, arch: str) -> dict[str, str]:
    """HF name -> the file's storage type of that tensor ("Q4_K", "Q8_0", "F32", ...): what
    `weights="int4"` keeps as the file has it (structkv.models.quantized)."""
    name_map = hf_names(cfg, arch)
    return {name_map[t.name]: t.tensor_type.name for t in reader.tensors if t.name in name_map}


def gguf_state_dict(reader, cfg: ModelConfig, dtype: torch.dtype, arch: str = "gemma3") -> dict[str, torch.Tensor]:
    """Dequantize every tensor to `dtype` under its HF name; unknown GGUF names raise."""
    gguf = _import_gguf()
    name_map = hf_names(cfg, arch)
    unexpected = [t.name for t in reader.tensors if t.name not in name_map]
    if "rope_freqs.weight" in unexpected:
        raise ValueError("this GGUF stores llama3-style RoPE frequency factors (rope_freqs), not supported yet; "
                         "load the HF folder instead")
    if unexpected:
        raise ValueError(f"unexpected tensors in GGUF file: {unexpected[:5]} (of {len(unexpected)})")
    sd = {}
    row = gguf_architecture(arch)
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy())
        if row.gemma_norms and t.name.endswith("norm.weight"):  # GGUF stores Gemma norms as (1 + w)
            w = w - 1.0
        if row.permuted_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute(w, cfg.num_heads if "attn_q" in t.name else cfg.num_kv_heads)
        sd[name_map[t.name]] = w.to(dtype)
    return sd
