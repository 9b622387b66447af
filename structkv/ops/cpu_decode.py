"""`structkv::cpu_decode_attention`: the decode attention's CPU kernel (csrc/decode_attention.c).
One query token per row over float32, bfloat16, int8 or int4 KV entries, every key and value row
read once for all the query heads of its KV head (research/benchmarks_log.md has the measurements that
called for it: PyTorch's CPU flash attention spent most of a small model's decode step on its
fixed costs). The C kernel is compiled inside a C++ op (csrc/decode_attention_op.cpp, against
torch's headers) on first use into `$STRUCTKV_CACHE/kernels` (named by a digest of both sources,
the flags, the compiler, the CPU and the torch version, written atomically) and loaded into the
dispatcher: a compiled decode step calls it as one opaque node with no Python in between (the
earlier ctypes call from a Python body cost ~30 us a layer a token). Where no compiler is found or
the build fails, `available()` is False with the reason in `unavailable_reason()`, and the callers
keep PyTorch's SDPA (the reference). `STRUCTKV_CPU_KERNELS=0` turns the kernel off (to compare
against the reference).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from .building import native_library, torch_extension_flags

KERNEL = Path(__file__).parent / "csrc" / "decode_attention.c"
SOURCE = Path(__file__).parent / "csrc" / "decode_attention_op.cpp"
KINDS = {"float32": 0, "bfloat16": 1, "bf16": 1, "int8": 2, "int4": 3}  # "bf16": the cache's kv_dtype name
MAX_G, MAX_D, VECTOR = 16, 512, 16  # the kernel's fixed limits (csrc: MAX_G, MAX_D, L)

_LIB = torch.library.Library("structkv", "FRAGMENT")
_LIB.define("cpu_decode_attention(Tensor q, Tensor[] k, Tensor[] v, Tensor mask, float scale, str kind, "
            "int threads) -> Tensor")


_LIB.define("cpu_decode_attention_at(Tensor q, Tensor[] k, Tensor[] v, Tensor pos, Tensor at, int window, float scale, "
            "str kind, int threads) -> Tensor")


@torch.library.register_fake("structkv::cpu_decode_attention", lib=_LIB)
def _(q, k, v, mask, scale, kind, threads):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("structkv::cpu_decode_attention_at", lib=_LIB)
def _(q, k, v, pos, at, window, scale, kind, threads):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@functools.cache
def _load() -> tuple[bool, str]:
    """(True, "") once the op's CPU kernel is registered, or (False, why not)."""
    salt = torch.__version__ + hashlib.sha256(KERNEL.read_bytes()).hexdigest()  # the included kernel keys the build
    lib, why = native_library(SOURCE, "CXX", ("c++", "g++", "clang++"), *torch_extension_flags(), salt=salt,
                              what="the CPU decode kernel")
    if lib is None:
        return False, why
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return False, f"the CPU decode kernel could not be loaded: {e}"
    return True, ""


def available() -> bool:
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (CPU, G and D within its limits, D a multiple of 16);
    traceable: callers inside a compiled step ask `available()` once, outside it."""
    G, D = q.shape[1] // k.shape[1], q.shape[-1]
    return q.device.type == "cpu" and G <= MAX_G and D <= MAX_D and D % VECTOR == 0


def cpu_decode_attention(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], mask: torch.Tensor,
                         scale: float, kind: str, threads: int) -> torch.Tensor:
    """q (B, Hq, 1, D) over k, v planes (B, Hkv, T, last) of `kind` ("float32" / "bfloat16": the
    entries; "int8" / "int4": the planes of `structkv.ops.kv_quant.quantize_kv`) with a bool mask
    (B, 1|Hkv, 1, T) -> (B, Hq, 1, D) in q's dtype, on `threads` threads. The caller checks
    `available` and `fits` first (shapes past the limits raise ValueError)."""
    return torch.ops.structkv.cpu_decode_attention(q, list(k), list(v), mask, scale, kind, threads)


def cpu_decode_attention_at(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], pos: torch.Tensor,
                            at: torch.Tensor, window: int | None, scale: float, kind: str,
                            threads: int) -> torch.Tensor:
    """`cpu_decode_attention` with the keys each row sees read from the slots' original positions
    pos (B, Hkv, T) int64 (-1 empty) against the rows' query positions at (B, 1): 0 <= pos <= at and,
    with a `window`, at - pos < window (`structkv.ops.visible`'s rule), decided inside the kernel.
    Why: the mask it stands for took a separate pass over every slot of every layer's cache."""
    return torch.ops.structkv.cpu_decode_attention_at(q, list(k), list(v), pos, at, window or 0, scale, kind, threads)
