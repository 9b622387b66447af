"""When torch.compile pays for a call, and where its graphs persist.

Compiling the decode step makes each token cheaper, but the compile itself costs tens of
seconds the first time on a machine and a few seconds when inductor's on-disk cache already
holds the graphs (dynamo still traces). A short generation therefore runs eager, and a long one
compiles. The prefill runs eager under "auto": its work is dominated by matmuls and the opaque
attention op, so compiling it gains little (docs/benchmarks.md) and costs a second graph.

Whether the graphs for a model are already on disk is remembered by a marker file per
(model shape, dtype, device, torch version), written after a compiled call succeeded. Inductor's
cache goes to `$STRUCTKV_CACHE/inductor` unless `TORCHINDUCTOR_CACHE_DIR` is set, so it persists
across processes and reboots (inductor's own default is a temporary folder).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from .fetch import cache_root

# Tokens to generate from which compiling the decode step is faster overall. Measured on the
# 2-core CPU reference machine with Gemma 3 270M at a 4K context (docs/benchmarks.md, "Start-up"):
# compiling the decode step costs ~68 s cold (no graphs on disk) and ~12 s warm, and saves
# ~9.5 ms per token (16.0 vs 13.9 tok/s), so it pays from ~7000 and ~1300 tokens.
DECODE_TOKENS_COLD = 8192
DECODE_TOKENS_WARM = 1536


def use_persistent_cache() -> str:
    """Point inductor at the user cache unless the caller chose a folder; returns the folder."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _marker(model, kind: str):
    key = json.dumps([model.config.to_dict(), str(model.dtype), model.device.type, torch.__version__, kind],
                     sort_keys=True, default=str)
    return cache_root() / "compiled" / hashlib.sha256(key.encode()).hexdigest()[:24]


def is_warm(model, kind: str = "decode") -> bool:
    """Whether a compiled `kind` graph for this model was built on this machine before."""
    return _marker(model, kind).exists()


def mark_warm(model, kind: str = "decode") -> None:
    """Remember that `kind` compiled for this model (best effort: an unwritable cache is fine)."""
    path = _marker(model, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass


def should_compile_decode(model, new_tokens: int) -> bool:
    """compile="auto": compile the decode step only when `new_tokens` repay the compile time."""
    threshold = DECODE_TOKENS_WARM if is_warm(model) else DECODE_TOKENS_COLD
    return new_tokens >= threshold
