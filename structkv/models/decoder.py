"""A minimal, self-contained decoder for Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text).

Design choices (read before changing anything):
- HF module names everywhere, so a HF safetensors checkpoint maps onto `state_dict()` one to one,
  and HF `rotate_half` RoPE, so no q/k permutation is needed.
- Every token carries its *original position id*. RoPE and the attention mask (causal, sliding
  window) are computed from positions, never from indices: a subset of the tokens, fed with their
  original positions, sees exactly the attention it would see in the full sequence restricted to
  the kept keys. Position -1 marks padding (left padding, empty cache slots): never a visible key.
- KV layout is (B, Hkv, T, D) everywhere, keys stored after RoPE.
- The model is built on the meta device and loaded with `assign=True`; `init_buffers()` then
  computes the RoPE tables, because `__init__` runs on meta.

Notation used for tensor shapes:
    B: batch, S: query tokens, T: key tokens, Hq: query heads, Hkv: KV heads, D: head dim,
    E: hidden size, V: vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import (
    CAUSAL_BLOCK,
    causal_attention,
    decode_attention,
    masked_attention,
    rows_in_order,
    sliding_window_attention,
)
from . import linear
from .config import ModelConfig, inv_frequencies
from .linear import Linear, skinny

# What an `on_layer` hook returns to end `Decoder.run` early (no token needs the deeper layers).
STOP = "stop"


class RMSNorm(nn.Module):
    """RMSNorm; `plus_one` is Gemma's (1 + w) flavour computed in float32."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of shape (B, 1, S, D) for `positions` (B, S); padding (-1) gets harmless values."""
    freqs = positions.clamp(min=0).float()[..., None] * inv_freq  # (B, S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window_at(layer)
        self.scale = cfg.scale
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, plus_one=cfg.gemma_norms)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, plus_one=cfg.gemma_norms)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = None  # q, k and v as one product once quantized (`quantized.fuse_projections`)

    def project(self, x: torch.Tensor):
        """x (B, S, E) -> q (B, S, Hq*D), k and v (B, S, Hkv*D): one product where fused."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_proj.sizes, -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project and rotate: q (B, Hq, S, D), k and v (B, Hkv, S, D)."""
        B, S, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(B, S, self.num_heads, self.head_dim)  # (B, S, Hq*D) -> (B, S, Hq, D)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)  # (B, S, Hkv, D)
        v = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, Hq, S, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, S, D)
        return q, k, v

    def attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q (B, Hq, S, D) over k, v (B, Hkv, T, D) with a bool mask (B, 1|Hkv, S, T).

        Returns (B, S, E) after the output projection.
        """
        B, Hq, S, D = q.shape
        Hkv = k.shape[1]
        if S == 1 and Hkv < Hq:  # one token: K/V read in place (`decode_attention`)
            return self.o_proj(decode_attention(q, k, v, mask, self.scale).reshape(B, 1, Hq * D))
        out = masked_attention(q, k, v, mask, self.scale)  # (B, Hq, S, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))  # (B, S, Hq*D) -> (B, S, E)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                ordered: bool | None = None):
        """x (B, S, E) at `positions` (B, S) -> (attention output (B, S, E), q, k, v).

        Without `cache` the tokens attend to themselves (blockwise ops). With a layer cache they
        attend to its entries and causally to each other, and are appended: the cache behind one
        call (`LayerKVCache.attention`; a question's recall layer, `structkv.modules.recall`, is
        another cache of this one call).
        """
        q, k, v = self.qkv(x, cos, sin)
        if cache is None:
            return self_attention(self, q, k, v, positions, ordered), q, k, v
        return cache.attention(self, q, k, v, positions), q, k, v


def self_attention(attn: "Attention", q, k, v, positions: torch.Tensor, ordered: bool | None = None) -> torch.Tensor:
    """Attention of the tokens over themselves: (B, S, E), blockwise through opaque ops (their
    block arithmetic on a dynamic length would otherwise add shape guards to a compiled prefill).
    `ordered`: `rows_in_order(positions)`, if known."""
    if attn.sliding_window is not None:
        out = sliding_window_attention(q, k, v, positions, attn.sliding_window, attn.scale)  # (B, Hq, S, D)
    else:
        out = causal_attention(q, k, v, positions, attn.scale, CAUSAL_BLOCK, ordered)  # (B, Hq, S, D)
    B, _, S, _ = out.shape
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))  # (B, S, E)


def run_block(block: "Block", h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              ordered: bool | None = None):
    """`block(h, positions, cos, sin)` as a free function of the block, so one compiled graph
    serves every layer of a kind (the compressed prefill compiles this)."""
    return block(h, positions, cos, sin, ordered=ordered)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"
        self.gate_up_proj = None  # gate and up as one product once quantized (`quantized.fuse_projections`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.sizes, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


class Block(nn.Module):
    """One decoder layer. Gemma 3 adds a norm after attention and around the MLP (four norms)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps, g = cfg.rms_norm_eps, cfg.gemma_norms
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        # Llama/Qwen: `post_attention_layernorm` is the pre-MLP norm. Gemma 3: it normalises the
        # attention output and `pre_feedforward_layernorm` is the pre-MLP norm.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        if g:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, g)
        self.sandwich = g

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                ordered: bool | None = None):
        """h (B, S, E) -> (new h, q, k, v); `cache`: this layer's `LayerKVCache`, if any; `ordered`:
        see `self_attention`."""
        out, q, k, v = self.self_attn(self.input_layernorm(h), positions, cos, sin, cache, ordered)
        return self.finish(h, out), q, k, v

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds and the MLP, given the attention output (B, S, E)."""
        if self.sandwich:
            h = h + self.post_attention_layernorm(attn_out)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)


class Decoder(nn.Module):
    """Causal LM with one forward (`forward`, over the layer loop `run`): the prompt pass, the
    decode step and `extend` are thin uses of it, and the compressed prefill (`structkv.compress`)
    is `run` with an `on_layer` hook that selects each layer's KV and propagates a token subset."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_types = sorted(set(cfg.layer_types))
        for t in self.rope_types:
            self.register_buffer(f"inv_freq_{t}", torch.empty(cfg.head_dim // 2), persistent=False)
        self.tokenizer = None  # set by structkv.models.load
        self.int8_head = None  # set by use_int8_head()
        self.weights = "fp32"  # the projections' storage: set by quantize()
        self.kv_dtype = None  # the KV caches' entries: None (this dtype), "int8", "int4" (structkv.ops.kv_quant)
        self.source_types: dict[str, str] = {}  # HF name -> GGUF storage type ("Q4_K"); {} for float files
        self.tp = None  # a structkv.distributed.TensorParallel when this is one rank's shard
        self.full_config = cfg  # the whole model's config (`config` holds a shard's local heads)

    # ------------------------------------------------------------------ setup
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Compute RoPE tables (they are not in checkpoints) and tie embeddings where configured."""
        device = device or self.lm_head.weight.device
        for t in self.rope_types:
            inv = inv_frequencies(self.config.rope[t], self.config.head_dim).to(device)
            setattr(self, f"inv_freq_{t}", inv)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_int8_head(self) -> "Decoder":
        """Compute one row's next-token logits from an exact int8 copy of the LM head
        (`Int8BlockHead`): GGUF Q8_0 heads (Gemma 3 270M's) are int8 blocks, so single-stream decode
        reads 4x fewer head bytes for the same numbers (speed: research/benchmarks_log.md). Batches keep the
        float head. Raises if the head is not exactly int8 blocks; costs 1/4 of the head's bytes in
        memory. Returns the model."""
        from .int8_head import Int8BlockHead

        if self.weights != "fp32":
            raise ValueError(f"the exact int8 head needs the float head; these weights are {self.weights}")
        self.int8_head = Int8BlockHead.from_weight(self.lm_head.weight)
        return self

    def quantize(self, weights: str) -> "Decoder":
        """Store the projections and the LM head as `weights` ("fp32", "bf16", "int8", "int4"):
        see `structkv.models.quantized`. In place; returns the model (unchanged when its weights
        are already `weights`, so a caller may pass a model loaded with them)."""
        from .quantized import quantize_model

        if weights == self.weights:
            return self
        if self.weights != "fp32":
            raise ValueError(f"this model's weights are already {self.weights}; load it again to change them")
        if self.int8_head is not None and weights != "fp32":
            raise ValueError("the exact int8 head and quantized weights do not stack: use one of them")
        quantize_model(self, weights)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    # ------------------------------------------------------------------ pieces
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S) token ids -> (B, S, E); Gemma scales by sqrt(E) in the model dtype, like HF."""
        h = self.model.embed_tokens(tokens)
        if self.config.gemma_norms:
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        return h

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin (B, 1, S, D) per layer type for `positions` (B, S)."""
        return {t: rope_cos_sin(getattr(self, f"inv_freq_{t}"), positions, self.dtype) for t in self.rope_types}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) of hidden states (..., E). On CPU with float32 weights, up to
        `linear.HEAD_ROWS` rows (B, E) go as W @ h^T (`linear.skinny`): torch runs (B, E) @ (E, V) at
        a large vocabulary as a matrix-vector product per row (Gemma's 262K x 640 head, 2 threads:
        43 ms for one row, 89 for two, 138 for three; as W @ h^T 22, 19, 24 ms), and every decode
        step runs it, alone or for a batch of requests."""
        h = self.model.norm(h)
        if self.int8_head is not None and h.dim() == 2 and h.shape[0] == 1:  # decode of one row
            return self.int8_head.logits(h)
        if self.weights == "fp32" and h.dim() == 2 and h.device.type == "cpu" and h.shape[0] <= linear.HEAD_ROWS:
            return skinny(h, self.lm_head.weight).float()
        return self.lm_head(h).float()

    # ------------------------------------------------------------------ the forward
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None, on_layer=None,
                block=None, last: bool = False) -> torch.Tensor:
        """The one forward: tokens (B, S) at `positions` (B, S) -> float32 logits (B, S, V), or the
        last token's (B, V) with `last`.

        `cache`: a KV cache whose layers the tokens attend to and are appended to (decode, extend);
        None: the tokens attend to themselves. `on_layer`, `block`: see `run`.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        h, _ = self.run(self.embed(tokens), positions, cache=cache, on_layer=on_layer, block=block)
        return self.logits(h[:, -1] if last else h)

    def run(self, h: torch.Tensor, positions: torch.Tensor, start: int = 0, cache=None, on_layer=None, block=None):
        """Layers `start`.. on hidden states h (B, S, E): (h, positions) after the last layer.

        `on_layer(i, h, positions, q, k, v)` sees each layer's output and its q, k, v (RoPE applied);
        it may return new (h, positions) for the deeper layers (a token subset at its original
        positions: how the compressed prefill propagates), or `STOP` to end the loop there.
        `block(layer, h, positions, cos, sin)` runs a layer without a cache (default: the layer
        itself; the prefill passes a compiled one).
        """
        rope = self.rope_tables(positions)
        ordered = self._ordered(positions, cache)
        for i in range(start, self.config.num_layers):
            layer = self.model.layers[i]
            cos, sin = rope[self.config.layer_types[i]]
            if cache is not None:
                h, q, k, v = layer(h, positions, cos, sin, cache.layers[i])
            else:
                h, q, k, v = (block or run_block)(layer, h, positions, cos, sin, ordered)
            if on_layer is not None:
                step = on_layer(i, h, positions, q, k, v)
                if step is STOP:
                    break
                if step is not None:
                    h, positions = step
                    rope, ordered = self.rope_tables(positions), self._ordered(positions, cache)
        return h, positions

    def _ordered(self, positions: torch.Tensor, cache) -> bool | None:
        """`rows_in_order` once per set of positions, for the full-attention layers' self-attention
        (one host read where each layer used to make two); None where no layer needs it, or inside
        a compiled graph (a data-dependent bool there: the opaque op decides, as before)."""
        if cache is not None or not self.config.full_attention_layers or torch.compiler.is_compiling():
            return None
        return rows_in_order(positions)

    def prompt_pass(self, tokens: torch.Tensor, positions: torch.Tensor, block=None):
        """Uncompressed prompt pass: last-token logits (B, V) and each layer's (k, v); `block`: see `run`."""
        kv = []
        logits = self(tokens, positions, on_layer=lambda i, h, p, q, k, v: kv.append((k, v)), block=block, last=True)
        return logits, kv

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """One new token per row: tokens, positions (B, 1) -> logits (B, V); its K/V are written into
        every layer of `cache` in place (at its cursor, or its ring slot)."""
        return self(tokens, positions, cache=cache, last=True)

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, cache, every: bool = False) -> torch.Tensor:
        """Several new tokens per row on top of a cache (e.g. a question after a compressed
        context): last-token logits (B, V), or every token's (B, S, V) with `every` (teacher
        forcing, as the fidelity metric does)."""
        return self(tokens, positions, cache=cache, last=not every)
