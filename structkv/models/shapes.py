"""Random weights at the shapes of real models: speed and memory checks without downloads.

`structkv.models.load("random:qwen2.5-0.5b")` builds the architecture of the named model (its HF
config.json values, written down here) with seeded random weights and no tokenizer. Accuracy is
meaningless; latency, memory and KV bytes are those of the real model.
"""
from __future__ import annotations

import zlib

import torch

from .config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, hidden_act="silu", eos_token_id=151643),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True,
                         hidden_act="silu", eos_token_id=128001),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                         hidden_act="silu", eos_token_id=128001),
}


def random_model(shape: str, *, dtype=torch.float32, device="cpu", seed: int = 0, tp=None):
    """A Decoder with the architecture of `shape` (a key of SHAPES) and seeded random weights
    (with `tp`: this rank's shard, seeded per rank: for speed, not for comparing outputs)."""
    from .empty import empty_decoder

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; valid: {', '.join(SHAPES)}")
    cfg = ModelConfig.from_hf(SHAPES[shape])
    model = empty_decoder(cfg, tp).to(dtype).to_empty(device=device)  # cast on meta: no float32 copy on the device
    model.full_config = cfg
    device = torch.device(device)
    # Drawn where the weights live: an 8B model's numbers drawn on a host core and copied over take
    # minutes; a GPU's generator gives other numbers than the CPU's for the same seed.
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if cfg.gemma_norms else 1.0)  # Gemma norms scale by (1 + w)
            elif name.endswith("bias"):
                p.zero_()
            else:  # chunked so a large embedding does not need a second full-size float32 copy
                if tp is not None:  # replicated tensors equal on every rank, shards differ
                    from ..distributed.sharding import shard_slice

                    sharded = shard_slice(name, (tp.world, tp.world), tp.world, tp.rank) is not None
                    gen.manual_seed(seed + zlib.crc32(name.encode()) + (tp.rank + 1) * 1_000_003 * sharded)
                flat = p.view(-1)
                for start in range(0, flat.numel(), 1 << 24):
                    chunk = flat[start:start + (1 << 24)]
                    chunk.copy_(torch.randn(chunk.numel(), generator=gen, device=device).mul_(0.02))
    model.init_buffers(device)
    model.tokenizer = None
    return model.eval().requires_grad_(False)
