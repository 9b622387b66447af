"""What each rank holds, and reading only that from safetensors.

Megatron's split, as gpt-fast and torchtitan apply it: q/k/v and the MLP's gate/up projections by
output rows (whole GQA groups: rank r gets query heads r*Hq/N.. and the KV heads they read), the
output and down projections by input columns (`RowParallelLinear` sums the partial outputs).
Norms, the embedding and the LM head are replicated: every rank then has the same hidden states
and the same logits, so sampling needs no communication and every rank can decide alone what a
method keeps once the scores are gathered. The cost is the embedding and head on every rank.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..util.compiling import forget_structure
from .linear import RowParallelLinear

ROWS = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v)_proj\.(weight|bias)|mlp\.(gate|up)_proj\.weight)$")
COLUMNS = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")


def local_config(cfg, world: int):
    """The config of one rank's shard: its heads and MLP width."""
    if cfg.num_kv_heads % world:
        degrees = ", ".join(str(d) for d in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % d == 0)
        raise ValueError(f"tp={world} does not divide the model's {cfg.num_kv_heads} KV heads; use one of {degrees} "
                         "(replicating KV heads across ranks, as vLLM can, is not supported)")
    if cfg.intermediate_size % world:
        raise ValueError(f"tp={world} does not divide the MLP width {cfg.intermediate_size}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def shard_slice(name: str, shape: tuple, world: int, rank: int):
    """(dim, start, stop) of tensor `name` (full `shape`) held by `rank`, or None (replicated)."""
    dim = 0 if ROWS.search(name) else 1 if COLUMNS.search(name) else None
    if dim is None:
        return None
    size = shape[dim] // world
    return dim, rank * size, (rank + 1) * size


def read_shard(handle, name: str, world: int, rank: int) -> torch.Tensor:
    """Tensor `name` from an open safetensors file, only this rank's slice read."""
    part = handle.get_slice(name)
    spec = shard_slice(name, tuple(part.get_shape()), world, rank)
    if spec is None:
        return part[:]
    dim, start, stop = spec
    return part[start:stop] if dim == 0 else part[:, start:stop]


def shard_model(model, tp) -> None:
    """Make a Decoder built from `local_config` row-parallel where the split needs a sum (on the
    meta device, before weights are assigned) and attach the group as `model.tp`."""
    for block in model.model.layers:
        for parent, name in ((block.self_attn, "o_proj"), (block.mlp, "down_proj")):
            old = getattr(parent, name)
            setattr(parent, name, RowParallelLinear(old.in_features, old.out_features, tp,
                                                    bias=old.bias is not None).to(old.weight.device))
    model.tp = tp
    forget_structure(model)  # changed in place: not the structure a compiled graph may have seen
