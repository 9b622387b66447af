"""Compiling: the one registry of compiled functions, where graphs persist, and when it pays.

`compiled(fn, **options)` compiles `fn` once per process (per backend and options) and returns
the compiled callable; it is what the decode step, the full prefill, the layer blocks of the
compressed prefill and the int8 LM head use. Compiled calls raise dynamo's recompile limit only
for themselves (torch.compile's own `recompile_limit`; every distinct model or batch size adds a
cache entry for the same code), never for the whole process, and a call past that limit runs
eager instead of failing (an evaluation of hundreds of prompts meets hundreds of compressed-cache
shapes).

Compiling the decode step makes each token cheaper, but the compile itself costs tens of
seconds the first time on a machine and a few seconds when inductor's on-disk cache already
holds the graphs (dynamo still traces). A short generation therefore runs eager, and a long one
compiles. The prefill runs eager under "auto": its work is dominated by matmuls and the opaque
attention op, so compiling it gains little (research/benchmarks_log.md) and costs a second graph.

The decode step is compiled per model structure (`compiled_per_model`): dynamo's own guards on
the model argument (every module's type and attributes, every parameter's shape, stride and
aliasing) are ~10,000 checks for a 30-layer model, 1.3 ms of a 10 ms SmolLM2 step on the 2-core
CPU; they are dropped, and a digest of the same facts, computed once per model, picks a function
with its own code object (so its own dynamo cache) instead. Models of one structure share the
graphs, as they did under the guards. Whoever changes a model's modules in place after a compiled
call must call `forget_structure(model)` (structkv's own in-place converters do).

Whether the graphs for a model are already on disk is remembered by a marker file per
(model shape, dtype, device, torch version), written after a compiled call succeeded. Inductor's
cache goes to `$STRUCTKV_CACHE/inductor` unless `TORCHINDUCTOR_CACHE_DIR` is set, so it persists
across processes and reboots (inductor's own default is a temporary folder).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import types

import torch

from .fetch import cache_root

# Tokens to generate from which compiling the decode step is faster overall: its compile time
# divided by what it saves per token, cold (no graphs on disk) and warm, as measured on the 2-core
# CPU reference machine (research/benchmarks_log.md, "Start-up").
DECODE_TOKENS_COLD = 8192
DECODE_TOKENS_WARM = 1536
# On a GPU an eager decode step is bound by its hundreds of kernel launches a token, which the
# compiled graph fuses, so the step is compiled from the first token (the CPU figures above do not
# carry over; `benchmarks/gpu_check.sh` times eager against compiled where a GPU is lent).
GPU_DECODE_TOKENS = 1


RECOMPILE_LIMIT = 64
_COMPILED: dict = {}


def compiled(fn, backend: str = "inductor", **options):
    """`torch.compile(fn, backend=backend, **options)`, created once and reused."""
    key = (fn, backend, tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                     for k, v in options.items())))
    if key not in _COMPILED:
        use_persistent_cache()
        # torch.compile pops keys out of a dict in `options` (guard_filter_fn): give it a copy.
        # The limit is the call's own (a config.patch around every call cost ~50-130 us a step).
        graph = torch.compile(fn, backend=backend, recompile_limit=RECOMPILE_LIMIT,
                              **{k: dict(v) if isinstance(v, dict) else v for k, v in options.items()})

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return graph(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                # A long run meets more shapes than the limit (each compressed cache has its own
                # kept sizes): the graphs it has keep serving their shapes, a new one runs eager.
                # Dynamo raises before running anything, so the eager call is the first.
                return fn(*args, **kwargs)

        _COMPILED[key] = call
    return _COMPILED[key]


_STRUCTURE_ATTR = "_structkv_structure"


def structure_key(model: torch.nn.Module) -> str:
    """A digest of what a graph traced through `model` specialises on: every module's type and
    plain attributes (numbers, strings, flags, dtypes, dataclass configs), every parameter's and
    buffer's name, shape, stride, dtype, device and which ones alias. Computed once per model
    (cached on it; `forget_structure` drops it)."""
    key = model.__dict__.get(_STRUCTURE_ATTR)
    if key is None:
        key = hashlib.sha256(repr(_structure(model)).encode()).hexdigest()[:16]
        model.__dict__[_STRUCTURE_ATTR] = key
    return key


def forget_structure(model: torch.nn.Module) -> None:
    """Drop the cached `structure_key` after changing `model`'s modules in place."""
    model.__dict__.pop(_STRUCTURE_ATTR, None)


def _plain(value):
    """value if a graph could bake it in as a constant (containers and dataclass fields item by
    item), else its type's name."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(tuple(sorted((f.name, _plain(getattr(value, f.name))) for f in dataclasses.fields(value))))
    return type(value).__qualname__


def _structure(model: torch.nn.Module) -> list:
    seen: dict[int, int] = {}  # tensor id -> first index: aliasing (tied weights) is structure too
    out = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = sorted((k, _plain(v)) for k, v in vars(module).items()
                       if not k.startswith("_") and not isinstance(v, (torch.Tensor, torch.nn.Module)))
        out.append((name, type(module).__module__, type(module).__qualname__, attrs))
        tensors = list(module._parameters.items()) + list(module._buffers.items())
        for pname, t in tensors:
            if t is not None:
                alias = seen.setdefault(id(t), len(seen))
                out.append((pname, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, alias))
    return out


_ON_MODEL = re.compile(r"(?:\w+\()*model(?:$|[.\[)])")  # model, model._modules[...], dict(type(model)...)


def _skip_model_guards(entries) -> list[bool]:
    """guard_filter_fn: keep every guard but those on the `model` argument (`structure_key` stands
    for them)."""
    return [not _ON_MODEL.match(e.name) for e in entries]


_OWN_CODE: dict = {}


def _own_code(fn, tag: str):
    """A copy of `fn` with a code object of its own: dynamo keeps its compiled graphs and guards
    on the code object, so each copy has a cache of its own."""
    key = (fn, tag)
    if key not in _OWN_CODE:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
        _OWN_CODE[key] = functools.wraps(fn)(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                                                                fn.__closure__))
    return _OWN_CODE[key]


def compiled_per_model(fn, backend: str = "inductor", inductor: dict | None = None, **options):
    """`compiled(fn)` for `fn(model, *args)` without dynamo's guards on `model` (their cost grows
    with the layer count), one copy of `fn` per `structure_key(model)` instead. `inductor`: inductor
    config for these graphs (ignored by other backends)."""
    own = dict(inductor or {}) if backend == "inductor" else {}
    options = dict(options, options={"guard_filter_fn": _skip_model_guards, **own})
    graphs: dict[str, object] = {}  # structure key -> compiled copy

    def call(model, *args, **kwargs):
        key = structure_key(model)
        if key not in graphs:
            graphs[key] = compiled(_own_code(fn, key), backend, **options)
        return graphs[key](model, *args, **kwargs)

    return call


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
    """compile="auto": compile the decode step only when `new_tokens` repay the compile time (on
    a GPU: always)."""
    if model.device.type == "cuda":
        return new_tokens >= GPU_DECODE_TOKENS
    threshold = DECODE_TOKENS_WARM if is_warm(model) else DECODE_TOKENS_COLD
    return new_tokens >= threshold
