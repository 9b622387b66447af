"""What each supported architecture fixes, in one table both config readers use.

`ModelConfig.from_hf` (a HF `config.json`) and `gguf_file.gguf_config` (GGUF metadata) read
sizes from their own formats, but the facts a format does not state (Qwen2's q/k/v bias, which
families norm q and k, Gemma's norm flavour and layer pattern, llama.cpp's rotary permutation)
are decided here once, so the two readers cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str  # HF config.json `model_type` (what ModelConfig.model_type holds)
    gguf: str  # GGUF `general.architecture`
    attention_bias: bool = False  # q/k/v projections carry a bias whatever the config says (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + w) RMSNorm, sandwich norms, scaled embeddings, query_pre_attn_scalar
    activation: str = "silu"  # the MLP's activation when the config names none
    tied_embeddings: bool = False  # LM head tied to the embedding when the config does not say
    global_every: int | None = None  # every n-th layer full attention, the rest sliding (when not listed)
    local_theta: float | None = None  # RoPE base of the sliding layers where GGUF metadata has none
    permuted_qk: bool = False  # llama.cpp's converter interleaves the rotary halves of q and k rows


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "llama", permuted_qk=True),
    Architecture("mistral", "mistral", permuted_qk=True),
    Architecture("qwen2", "qwen2", attention_bias=True),
    Architecture("qwen3", "qwen3", qk_norm=True),
    Architecture("gemma3_text", "gemma3", qk_norm=True, gemma_norms=True, activation="gelu_tanh",
                 tied_embeddings=True, global_every=6, local_theta=10000.0),
)}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
GGUF_ARCHITECTURES = tuple(sorted(a.gguf for a in ARCHITECTURES.values()))


def architecture(model_type: str) -> Architecture:
    """The table's row for a HF `model_type`; a clear error for any other."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; structkv supports: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def gguf_architecture(name: str) -> Architecture:
    """The table's row for a GGUF `general.architecture`."""
    for a in ARCHITECTURES.values():
        if a.gguf == name:
            return a
    raise ValueError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)}); "
                     "load a HF safetensors folder instead")


def global_pattern(arch: Architecture, n_layers: int, every: int | None = None) -> tuple[str, ...]:
    """Layer types of an architecture whose every n-th layer is global (Gemma 3: 5 local, 1 global)."""
    every = every or arch.global_every
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers))
