"""empty_decoder: a Decoder without memory, to be filled by loading (`assign=True`) or at random.

Its own module because it joins the decoder and tensor parallelism (a rank's shard is the
decoder of `local_config` made row-parallel by `structkv.distributed`), which the decoder itself
must not import. The dependency runs one way: models use distributed, never the reverse.
"""
from __future__ import annotations

import torch

from ..distributed.sharding import local_config, shard_model
from .config import ModelConfig
from .decoder import Decoder


def empty_decoder(cfg: ModelConfig, tp=None) -> Decoder:
    """A Decoder for `cfg` on the meta device (no memory until weights are assigned or
    materialised), or with `tp` (a `structkv.distributed.TensorParallel`) this rank's part of it."""
    with torch.device("meta"):
        return Decoder(cfg) if tp is None else sharded_decoder(cfg, tp)


def sharded_decoder(cfg: ModelConfig, tp) -> Decoder:
    """This rank's part of a Decoder for the whole model's `cfg`: local heads and MLP width,
    row-parallel where the split needs a sum (build it under the meta device, then assign weights)."""
    model = Decoder(local_config(cfg, tp.world))
    shard_model(model, tp)
    return model
