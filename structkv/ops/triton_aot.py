"""Compile the Triton kernels ahead of time for a GPU target and read what each one uses.

The GPU checks that need no GPU: Triton's compiler and ptxas run on any machine, so every kernel
is compiled for sm_80 / sm_90 at the block sizes its wrapper picks (`triton_kernels.*_config`),
and the cubin is read back with the wheel's own `cuobjdump` / `nvdisasm`: registers, spill stores,
shared memory, tensor-core instructions. `python -m structkv.ops.triton_aot` prints the table;
tests/test_triton_aot.py asserts on it.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHS = (80, 90)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16", "fp32")
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}  # opt-in shared memory per block: A100, H100
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class KernelReport:
    kernel: str
    arch: int
    dtype: str
    head_dim: int
    registers: int
    spill_stores: int  # STL instructions in the SASS: registers spilled to local memory
    stack_bytes: int
    shared_bytes: int
    tensor_core_ops: int  # HMMA (sm_80) or HGMMA (sm_90) instructions


def _bin(tool: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def _signature(fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    """Triton types of every argument: named pointers, float scalars, int32 for the rest."""
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in pointers:
            return "*" + pointers[name]
        return "fp32" if name in floats else "i32"
    return {name: kind(name) for name in fn.arg_names}


def _read_cubin(cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, stack bytes, spill stores, tensor-core instructions) of a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return (int(regs.group(1)), int(stack.group(1)), len(re.findall(r"\bSTL\b", sass)),
            len(re.findall(r"\bH(?:G)?MMA\b", sass)))


def compile_kernel(fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict, arch: int):
    """Triton's CompiledKernel of `fn` for sm_<arch> (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps", 4)}  # a launch option, not an argument
    names = fn.arg_names
    src = ASTSource(fn, signature=_signature(fn, pointers, floats, constexprs),
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _cases(dtype: str, head_dim: int):
    """(name, kernel, pointer types, float args, constexprs): every kernel at its wrapper's blocks,
    with its heaviest flags (sliding window, softcap, entropy; int4's two halves)."""
    from . import triton_kernels as tk

    t = dtype
    window = tk.window_config(64, head_dim, _TORCH[dtype])
    flags = dict(GROUP=4, HAS_WINDOW=True, HAS_SOFTCAP=True, **window)
    scores = dict(Q=t, K=t, QPOS="i64", KPOS="i64")
    floats = ("scale", "softcap")
    yield ("window_stats", tk._window_stats, dict(scores, M_OUT="fp32", L_OUT="fp32", E_OUT="fp32"), floats,
           dict(flags, WITH_ENTROPY=True))
    yield "window_saliency", tk._window_saliency, dict(scores, LSE="fp32", SAL="fp32"), floats, flags
    yield ("compact", tk._compact, dict(K=t, V=t, KPOS="i64", IDX="i64", KC=t, VC=t, PC="i64"), (),
           tk.compact_config(head_dim))
    for kind, codes in (("int8", "i8"), ("int4", "u8")):
        dc = head_dim // 2 if kind == "int4" else head_dim
        planes = dict(KC=codes, KS="bf16", KM="bf16", VC=codes, VS="bf16", VM="bf16")
        yield (f"quantized_decode_{kind}", tk._quantized_decode,
               dict(planes, Q=t, MASK="i8", ACC="fp32", M_OUT="fp32", L_OUT="fp32"), ("scale",),
               dict(GROUP=4, GROUP_D=32, **tk.decode_config(dc, kind == "int4")))


def report(arch: int, dtype: str, head_dim: int) -> list[KernelReport]:
    """Compile every kernel for one (arch, dtype, head_dim) and read its resource use."""
    out = []
    for name, fn, pointers, floats, constexprs in _cases(dtype, head_dim):
        kernel = compile_kernel(fn, pointers, floats, constexprs, arch)
        regs, stack, spills, mma = _read_cubin(kernel.asm["cubin"])
        out.append(KernelReport(name, arch, dtype, head_dim, regs, spills, stack, kernel.metadata.shared, mma))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(map(str, ARCHS)))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    a = p.parse_args()
    print("| kernel | sm | dtype | head_dim | registers | spill stores | stack B | shared B | tensor-core ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in map(int, a.archs.split(",")):
        for dtype in a.dtypes.split(","):
            for d in map(int, a.head_dims.split(",")):
                for r in report(arch, dtype, d):
                    print(f"| {r.kernel} | {r.arch} | {r.dtype} | {r.head_dim} | {r.registers} | {r.spill_stores} "
                          f"| {r.stack_bytes} | {r.shared_bytes} | {r.tensor_core_ops} |")


if __name__ == "__main__":
    main()
