"""Compiling: the one registry of compiled functions, where graphs persist, and when it pays.

`compiled(fn, **options)` compiles `fn` once per process (per backend and options) and returns
the compiled callable; it is what the decode step, the full prefill, the layer blocks of the
compressed prefill and the int8 LM head use. Compiled calls raise dynamo's recompile limit only
for themselves (every distinct model or batch size adds a cache entry for the same code), never
for the whole process, and a call past that limit runs eager instead of failing (an evaluation of
hundreds of prompts meets hundreds of compressed-cache shapes).

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

import functools
import hashlib
import json
import os

import torch

from .fetch import cache_root

# Tokens to generate from which compiling the decode step is faster overall: its compile time
# divided by what it saves per token, cold (no graphs on disk) and warm, as measured on the 2-core
# CPU reference machine (docs/benchmarks.md, "Start-up").
DECODE_TOKENS_COLD = 8192
DECODE_TOKENS_WARM = 1536


RECOMPILE_LIMIT = 64
_COMPILED: dict = {}


def compiled(fn, backend: str = "inductor", **options):
    """`torch.compile(fn, backend=backend, **options)`, created once and reused."""
    key = (fn, backend, tuple(sorted(options.items())))
    if key not in _COMPILED:
        use_persistent_cache()
        graph = torch.compile(fn, backend=backend, **options)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                try:
                    return graph(*args, **kwargs)
                except torch._dynamo.exc.FailOnRecompileLimitHit:
                    # A long run meets more shapes than the limit (each compressed cache has its own
                    # kept sizes): the graphs it has keep serving their shapes, a new one runs eager.
                    # Dynamo raises before running anything, so the eager call is the first.
                    return fn(*args, **kwargs)

        _COMPILED[key] = call
    return _COMPILED[key]


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
