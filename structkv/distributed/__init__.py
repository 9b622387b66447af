"""Tensor parallelism on torch.distributed (docs/distributed.md).

`structkv.load(name, tp=N)` under `torchrun --nproc-per-node N`: each rank reads only its shard of
the weights (whole GQA groups of heads, slices of the MLP), the output and down projections
all-reduce their partial sums (functional collectives, so compiled graphs keep them), and every
compression decision is made on scores gathered from all heads, so all ranks keep the same tokens.

Pieces: `group` (the process group and its collectives), `sharding` (what each rank holds, read
slice by slice from safetensors), `linear` (the row-parallel projection).
"""
from .group import TensorParallel, init
from .sharding import local_config, shard_model

__all__ = ["TensorParallel", "init", "local_config", "shard_model"]
