"""empty_decoder: a Decoder without memory, to be filled by loading (`assign=True`) or at random.

Its own module because it joins the decoder and tensor parallelism (a rank's shard is built by
`structkv.distributed`), which the decoder itself must not import.
"""
from __future__ import annotations

import torch

from ..distributed.sharding import sharded_decoder
from .config import ModelConfig
from .decoder import Decoder


def empty_decoder(cfg: ModelConfig, tp=None) -> Decoder:
    """A Decoder for `cfg` on the meta device (no memory until weights are assigned or
    materialised), or with `tp` (a `structkv.distributed.TensorParallel`) this rank's part of it."""
    with torch.device("meta"):
        return Decoder(cfg) if tp is None else sharded_decoder(cfg, tp)
