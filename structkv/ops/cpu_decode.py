"""`structkv::cpu_decode_attention`: the decode attention's CPU kernel (csrc/decode_attention.c).

One query token per row over float32, bfloat16, int8 or int4 KV entries, every key and value row
read once for all the query heads of its KV head (docs/benchmarks.md has the measurements that
called for it: PyTorch's CPU flash attention spent most of a small model's decode step on its
fixed costs). The C source is built on first use with the system's C compiler into
`$STRUCTKV_CACHE/kernels` (named by a digest of the source, the flags, the compiler and the CPU,
written atomically) and called through ctypes inside an opaque custom op, so a compiled decode
step keeps it as one node. Where no compiler is found or the build fails, `available()` is False
with the reason in `unavailable_reason()`, and the callers keep PyTorch's SDPA (the reference).
`STRUCTKV_CPU_KERNELS=0` turns the kernel off (to compare against the reference).
"""
from __future__ import annotations

import array
import ctypes
import functools
from pathlib import Path

import torch

from .building import native_library

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
KINDS = {"float32": 0, "bfloat16": 1, "bf16": 1, "int8": 2, "int4": 3}  # "bf16": the cache's kv_dtype name
MAX_G, MAX_D, VECTOR = 16, 512, 16  # the kernel's fixed limits (csrc: MAX_G, MAX_D, L)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    path, why = native_library(SOURCE, "CC", ("cc", "gcc", "clang"), FLAGS, ["-lm"], what="the CPU decode kernel")
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"the CPU decode kernel could not be loaded: {e}"
    fn = lib.structkv_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_float]
    return lib, ""


def available() -> bool:
    return _load()[0] is not None


def unavailable_reason() -> str:
    return _load()[1]


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (CPU, G and D within its limits, D a multiple of 16);
    traceable: callers inside a compiled step ask `available()` once, outside it."""
    G, D = q.shape[1] // k.shape[1], q.shape[-1]
    return q.device.type == "cpu" and G <= MAX_G and D <= MAX_D and D % VECTOR == 0


def kernel_splits(B: int, Hkv: int, threads: int) -> int:
    """The most key ranges per (row, KV head) the kernel may use, which sizes its work buffer:
    enough tasks for every thread twice over. The kernel picks the number itself (csrc
    `key_ranges`: the same cap, and no range under 128 of the slots its mask shows)."""
    splits = 1
    while B * Hkv * splits < 2 * threads:
        splits *= 2
    return splits


def _plane(planes: list[torch.Tensor]) -> list[int]:
    """csrc's plane(): codes, scale, minimum pointers (0 where absent), then each one's strides
    (elements) over (B, H, T)."""
    ptrs, strides = [0, 0, 0], [0] * 9
    for i, t in enumerate(planes):
        ptrs[i] = t.data_ptr()
        strides[3 * i:3 * i + 3] = t.stride()[:3]
    return ptrs + strides


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# Registered with torch.library's low-level API rather than `custom_op`: the op runs once per layer
# per token, and custom_op's Python layers (autograd wrapper, redispatch, aliasing check) cost ~11
# us a call against ~3.5 us here (a 30-layer model: ~0.2 ms of every step). Inference only.
_LIB = torch.library.Library("structkv", "FRAGMENT")
_LIB.define("cpu_decode_attention(Tensor q, Tensor[] k, Tensor[] v, Tensor mask, float scale, str kind, "
            "int threads) -> Tensor")


def cpu_decode_attention(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], mask: torch.Tensor,
                         scale: float, kind: str, threads: int) -> torch.Tensor:
    """q (B, Hq, 1, D) over k, v planes (B, Hkv, T, last) of `kind` ("float32" / "bfloat16": the
    entries; "int8" / "int4": the planes of `structkv.ops.kv_quant.quantize_kv`) with a bool mask
    (B, 1|Hkv, 1, T) -> (B, Hq, 1, D) in q's dtype. The caller checks `available` and `fits` first."""
    B, Hq, _, D = q.shape
    Hkv, T = k[0].shape[1], k[0].shape[2]
    G, splits = Hq // Hkv, kernel_splits(B, Hkv, threads)
    k, v = [_last_contiguous(t) for t in k], [_last_contiguous(t) for t in v]
    # (B, Hq, 1, D) contiguous is (B, Hkv, G, D) in memory: a KV head's G query rows together
    q32 = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    Hm = mask.shape[1]
    m = mask.reshape(mask.shape[0], Hm, T)  # (B, 1|Hkv, 1, T) -> (B, 1|Hkv, T)
    m = m.contiguous() if mask.shape[0] == B else m.expand(B, Hm, T).contiguous()
    out, work = torch.empty(B, Hq, 1, D), torch.empty(splits * B * Hkv * G * (D + 2))
    groups = k[1].shape[-1] if kind == "int4" else 1
    args = array.array("q", [KINDS[kind], q32.data_ptr(), out.data_ptr(), work.data_ptr(), m.data_ptr(), Hm * T,
                             T if Hm > 1 else 0, Hm, B, Hkv, G, T, D, groups, splits, threads, *_plane(k), *_plane(v)])
    if _load()[0].structkv_decode_attention(args.buffer_info()[0], scale):
        raise ValueError(f"cpu_decode_attention: G = {G}, D = {D} outside the kernel's limits (G <= {MAX_G}, D <= "
                         f"{MAX_D} and a multiple of {VECTOR}); check `fits` first")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


_LIB.impl("cpu_decode_attention", cpu_decode_attention, "CPU")


@torch.library.register_fake("structkv::cpu_decode_attention", lib=_LIB)
def _(q, k, v, mask, scale, kind, threads):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
