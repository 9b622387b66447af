"""Quantized weights on transparent huge pages: one arena for every quantized module's buffers.

Why: a decode step streams every weight once, from memory, in short runs (one product of 0.2-1 MB
after another). On 4 KB pages the int4 product loop streamed ~24 GB/s on two threads over 66 MB
of SmolLM2-shaped weights, on 2 MB pages ~33 GB/s (eec7727, an AVX-512 EPYC; a standalone loop
with and without madvise, research/benchmarks_log.md). Linux gives huge pages in its usual "madvise" mode
only to memory advised MADV_HUGEPAGE before it is first touched, and PyTorch's allocator advises
only single allocations of 2 MB and more (with THP_MEM_ALLOC_ENABLE set), while the weights are
hundreds of tensors under that. So `place_on_huge_pages` copies them into one arena, advised
before the copy, and the modules' buffers become views of it: the same shapes, strides, dtypes
and values, aliases kept (a tied head and embedding stay one tensor).

Off where the kernel has no transparent huge pages ("never", or no such file: not Linux), for
models not on the CPU, and with STRUCTKV_HUGE_PAGES=0 (to compare).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h)
ALIGN = 64  # each buffer's start in the arena: a cache line, and any dtype's size
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where there is none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), None)


def enabled() -> bool:
    return os.environ.get("STRUCTKV_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise")


def _advise(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + length); False where it is refused."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def place_on_huge_pages(model: torch.nn.Module, kinds: tuple[type, ...], minimum: int = HUGE_PAGE) -> int:
    """Move the CPU buffers of every module of `kinds` in `model` into one arena on huge pages (in
    place); returns the bytes moved, 0 where huge pages are off or there are under `minimum` bytes."""
    if not enabled():
        return 0
    owners, unique = [], {}  # (module, name, tensor); id -> tensor, first seen first
    for module in model.modules():
        if isinstance(module, kinds):
            for name, t in module._buffers.items():
                if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                    owners.append((module, name, t))
                    unique.setdefault(id(t), t)
    offsets, total = {}, 0
    for key, t in unique.items():
        offsets[key] = total
        total += -(-t.nbytes // ALIGN) * ALIGN
    if total < max(minimum, 1):
        return 0
    span = -(-total // HUGE_PAGE) * HUGE_PAGE  # the advised range: whole huge pages, inside the arena
    arena = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: fresh pages, advised first
    start = -arena.data_ptr() % HUGE_PAGE
    if not _advise(arena.data_ptr() + start, span):
        return 0
    views = {}
    for key, t in unique.items():
        at = start + offsets[key]
        views[key] = arena[at:at + t.nbytes].view(t.dtype).view(t.shape)  # (nbytes,) uint8 -> t's dtype and shape
        views[key].copy_(t)
    for module, name, t in owners:
        module._buffers[name] = views[id(t)]
    return total
