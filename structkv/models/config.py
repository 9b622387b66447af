"""One config dataclass for every supported decoder, read from HF `config.json` or GGUF metadata.

The decoder never looks at a raw HF dict: everything architecture-specific is decided here, once,
and stated as a plain field (norm flavour, activation, per-layer attention type and RoPE). What a
format leaves unsaid comes from `architectures.ARCHITECTURES`, the table the GGUF reader uses too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .architectures import architecture, global_pattern

if TYPE_CHECKING:
    import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of one attention type: base theta plus optional scaling (HF `rope_type` names)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    rope: dict[str, RopeConfig] = field(default_factory=dict)  # keyed by layer type
    attention_bias: bool = False
    qk_norm: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    gemma_norms: bool = False  # (1 + w) RMSNorm, sandwich norms, scaled embeddings
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self):
        self._check_values()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in set(self.layer_types):
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"unsupported layer type {t!r}: expected full_attention or sliding_attention")
            if t not in self.rope:
                raise ValueError(f"no RoPE parameters for layer type {t!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")

    def _check_values(self) -> None:
        """Types and ranges of every number: a string size, a negative epsilon or a zero RoPE base
        would otherwise load and generate garbage (or crash deep inside a layer)."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        if self.attn_scale is not None:
            _positive_float("attn_scale", self.attn_scale)
        for kind, rope in self.rope.items():
            for f in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
                _positive_float(f"rope[{kind}].{f}", getattr(rope, f))
            _positive_int(f"rope[{kind}].original_max_position_embeddings", rope.original_max_position_embeddings)
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"config field {name!r} must be a token id (int >= 0) or null, got {value!r}")

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def sliding_window_at(self, layer: int) -> int | None:
        """Sliding window of `layer`, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    # ------------------------------------------------------------------ readers
    def to_dict(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of `to_dict` (structkv's own serialised form, not a HF config)."""
        d = dict(d)
        d["rope"] = {k: RopeConfig(**v) for k, v in d["rope"].items()}
        d["layer_types"], d["eos_token_ids"] = tuple(d["layer_types"]), tuple(d["eos_token_ids"])
        return cls(**d)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a HF `config.json` dict (transformers 4.x or 5.x layout). Errors are
        ValueErrors that name the field."""
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object, got a {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type == "gemma3" and "text_config" in d:  # multimodal wrapper: use the text tower
            d, model_type = {**d["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
        arch = architecture(model_type)
        n_layers = _field(d, "num_hidden_layers")
        n_heads = _field(d, "num_attention_heads")
        hidden = _field(d, "hidden_size")
        _positive_int("num_hidden_layers", n_layers)
        _positive_int("num_attention_heads", n_heads)
        _positive_int("hidden_size", hidden)
        head_dim = d.get("head_dim") or hidden // n_heads
        gemma = arch.gemma_norms

        layer_types = d.get("layer_types")
        sliding_window = d.get("sliding_window")
        if layer_types is None:
            if arch.global_every:
                pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                layer_types = global_pattern(arch, n_layers, pattern)
            elif model_type == "mistral" and sliding_window:
                layer_types = ["sliding_attention"] * n_layers
            elif model_type in ("qwen2", "qwen3") and d.get("use_sliding_window") and sliding_window:
                first_full = d.get("max_window_layers", n_layers)
                layer_types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(n_layers)]
            else:
                layer_types = ["full_attention"] * n_layers
        if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"config field 'layer_types' must be a list of strings, got {layer_types!r}")
        layer_types = tuple(layer_types)
        if "sliding_attention" not in layer_types:
            sliding_window = None

        rope = _read_rope(d, gemma)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
            raise ValueError(f"config field 'eos_token_id' must be a token id or a list of them, "
                             f"got {d['eos_token_id']!r}")
        act = d.get("hidden_activation") or d.get("hidden_act") or arch.activation
        act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
        if act is None:
            raise ValueError(f"unsupported activation {d.get('hidden_act')!r}: expected silu or gelu_pytorch_tanh")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key):
                raise ValueError(f"{key}={d[key]} is not supported (Gemma 2 style soft-capping)")
        return cls(
            model_type=model_type,
            vocab_size=_field(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_field(d, "intermediate_size"),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            layer_types=layer_types,
            sliding_window=sliding_window,
            rope=rope,
            attention_bias=arch.attention_bias or bool(d.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            activation=act,
            gemma_norms=gemma,
            attn_scale=_query_scale(d) if gemma else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch.tied_embeddings)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")


def _positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config field {name!r} must be a finite number > 0, got {value!r}")


def _query_scale(d: dict) -> float | None:
    """Gemma's attention scale from query_pre_attn_scalar (None: 1/sqrt(head_dim))."""
    if not d.get("query_pre_attn_scalar"):
        return None
    value = _number(d, "query_pre_attn_scalar", None)
    _positive_float("query_pre_attn_scalar", value)
    return value**-0.5


def _field(d: dict, key: str):
    """A required field of config.json, or an error naming it."""
    if key not in d:
        raise ValueError(f"config field {key!r} is missing")
    return d[key]


def _number(p: dict, key: str, default, kind=float):
    value = p.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config field {key!r} must be a number, got {value!r}")
    return kind(value)


def _rope_from_params(p: dict, default_theta: float) -> RopeConfig:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    for key in ("rope_theta", "factor"):
        _positive_float(key, _number(p, key, default_theta if key == "rope_theta" else 1.0))
    return RopeConfig(
        theta=_number(p, "rope_theta", default_theta),
        rope_type=rope_type,
        factor=_number(p, "factor", 1.0),
        low_freq_factor=_number(p, "low_freq_factor", 1.0),
        high_freq_factor=_number(p, "high_freq_factor", 4.0),
        original_max_position_embeddings=_number(p, "original_max_position_embeddings", 8192, int),
    )


def _read_rope(d: dict, gemma: bool) -> dict[str, RopeConfig]:
    """RoPE per layer type, from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters")
    theta = _number(d, "rope_theta", 10000.0)
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ValueError(f"config field {key!r} must be an object (e.g. {{\"rope_type\": \"linear\", "
                             f"\"factor\": 2.0}}), got {d[key]!r}")
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3, v5)
        return {k: _rope_from_params(v, theta) for k, v in params.items()}
    if params:  # one set for all layers (v5)
        rc = _rope_from_params(params, theta)
        return {"full_attention": rc, "sliding_attention": rc}
    scaling = d.get("rope_scaling") or {}
    full = _rope_from_params({**scaling, "rope_theta": theta}, theta)
    if gemma:  # v4 Gemma 3: local layers use rope_local_base_freq without scaling
        local = RopeConfig(theta=_number(d, "rope_local_base_freq", 10000.0))
        return {"full_attention": full, "sliding_attention": local}
    return {"full_attention": full, "sliding_attention": full}


def inv_frequencies(rope: RopeConfig, head_dim: int) -> "torch.Tensor":
    """RoPE inverse frequencies (head_dim // 2,), float32, with linear or llama3 scaling applied."""
    import torch

    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq
