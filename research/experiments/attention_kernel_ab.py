"""The CPU decode-attention kernel (csrc/decode_attention.c) of a git revision against the working
tree's, alternated call by call on one decode step's shapes, in one process: medians and their ratio.

Why: a kernel change is judged on the machine it targets (the AVX2 path of one commit, the
AVX-512 path of another), and this shared machine's speed moves between minutes, so the two builds
are timed side by side, not in separate runs.

    python research/experiments/attention_kernel_ab.py --before HEAD --heads 3 --groups 3 --dim 64 --tokens 1024 --threads 2
"""
from __future__ import annotations

import argparse
import array
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

C_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]  # the kernel alone, as C


def build(source: Path) -> ctypes.CDLL:
    from structkv.ops import building

    lib = ctypes.CDLL(str(building.build_library(source, building.find_compiler("CC", ("cc", "gcc")), C_FLAGS,
                                                 ["-lm"])))
    lib.structkv_decode_attention.restype = ctypes.c_int
    lib.structkv_decode_attention.argtypes = [ctypes.c_void_p, ctypes.c_float]
    return lib


def call(lib, q, k, v, mask, scale: float, kind: str, threads: int):
    """The kernel's C entry point on float32 / bfloat16 entries (B, Hkv, T, D) and a (B, 1, 1, T) mask:
    its arguments packed as csrc's structkv_decode_attention reads them (the op does this in C++)."""
    import torch

    from structkv.ops.cpu_decode import KINDS

    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    splits = 1
    while B * Hkv * splits < 2 * threads:
        splits *= 2
    out, work = torch.empty(B, Hq, 1, D), torch.empty(splits * B * Hq * (D + 2))
    m = mask.reshape(B, 1, T).contiguous()

    def plane(t):
        return [t.data_ptr(), 0, 0, *t.stride()[:3], *[0] * 6]

    args = array.array("q", [KINDS[kind], q.data_ptr(), out.data_ptr(), work.data_ptr(), m.data_ptr(), T, 0, 1, B,
                             Hkv, Hq // Hkv, T, D, 1, splits, threads, *plane(k), *plane(v)])
    if lib.structkv_decode_attention(args.buffer_info()[0], scale):
        raise ValueError("shape outside the kernel's limits")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="HEAD", help="git revision of the kernel source to compare against")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--kinds", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    import torch

    from structkv.ops import cpu_decode

    torch.set_num_threads(a.threads)
    path = "structkv/ops/csrc/decode_attention.c"
    old = subprocess.run(["git", "show", f"{a.before}:{path}"], capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "decode_attention.c").write_text(old)
        libs = {"before": build(Path(tmp) / "decode_attention.c"), "after": build(cpu_decode.KERNEL)}
    B, H, G, T, D = 1, a.heads, a.groups, a.tokens, a.dim
    q, k, v = torch.randn(B, H * G, 1, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    print(f"B={B} Hkv={H} G={G} T={T} D={D}, {a.threads} thread(s), median us of {a.calls} alternated calls\n")
    print("| KV entries | before (us) | after (us) | after / before speed |\n|---|---|---|---|")
    for kind in a.kinds.split(","):
        kk, vv = (k, v) if kind == "float32" else (k.to(torch.bfloat16), v.to(torch.bfloat16))
        times = {n: [] for n in libs}
        outs = {}
        for i in range(a.calls + 10):
            for name, lib in libs.items():
                t0 = time.perf_counter()
                outs[name] = call(lib, q, kk, vv, mask, D**-0.5, kind, a.threads)
                if i >= 10:
                    times[name].append(time.perf_counter() - t0)
        assert torch.allclose(outs["before"], outs["after"], atol=1e-5), "the two builds disagree"
        b, f = (statistics.median(times[n]) * 1e6 for n in ("before", "after"))
        print(f"| {kind} | {b:.0f} | {f:.0f} | {b / f:.2f}x |")


if __name__ == "__main__":
    main()
