"""Builds of csrc/tiled_linear.cpp side by side: one pass over every projection of a model (7 a
layer, one decode row, the weights quantized once and shared) through each build, alternated round
by round; the median ms a pass and its GB/s.

Why: a change inside the int4 / int8 kernels (a prefetch, an unrolling) moves a pass by a few
percent, less than a shared machine drifts between two runs; builds loaded into one process and
alternated see the same minutes. Each source is built with g++ -O3 -march=native (plus `--flags`,
e.g. `-mno-avx512f` for the AVX2 path on an AVX-512 machine) under its own op namespace, checked
against the float product of its codes, then timed. The weights are random (the time does not
depend on the values) and placed on huge pages as `quantize_model` places them.

    git show HEAD~1:structkv/ops/csrc/tiled_linear.cpp > /tmp/before.cpp
    python benchmarks/tiled_variants.py /tmp/before.cpp structkv/ops/csrc/tiled_linear.cpp --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SCHEMAS = ("int4_tiled_linear(Tensor x, Tensor codes, Tensor scale, Tensor lo, int dense_rows) -> Tensor",
           "int4_tiled_weight(Tensor codes, Tensor scale, Tensor lo) -> Tensor",
           "int8_tiled_linear(Tensor x, Tensor codes, Tensor scales, int dense_rows) -> Tensor",
           "int8_tiled_weight(Tensor codes, Tensor scales) -> Tensor")


def build(source: str, namespace: str, flags: list[str]) -> torch.library.Library:
    """`source` compiled with its ops registered under `namespace` (kept alive by the returned library)."""
    from torch.utils import cpp_extension

    text = Path(source).read_text().replace("TORCH_LIBRARY_IMPL(structkv,", f"TORCH_LIBRARY_IMPL({namespace},")
    text = text.replace("structkv_tiled_linear_isa", f"{namespace}_isa")  # one exported name per build
    out = Path(tempfile.mkdtemp())
    (out / "k.cpp").write_text(text)
    lib = torch.library.Library(namespace, "DEF")
    for schema in SCHEMAS:
        lib.define(schema)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    subprocess.run(["g++", "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c++17", abi,
                    *(f"-I{p}" for p in cpp_extension.include_paths()), str(out / "k.cpp"), "-o", str(out / "k.so"),
                    f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10"], check=True, capture_output=True)
    torch.ops.load_library(str(out / "k.so"))
    return lib


def product(namespace: str, bits: str):
    """(x, QuantizedLinear) -> x @ W^T through `namespace`'s build; the buffers read once, before timing."""
    ops = getattr(torch.ops, namespace)
    if bits == "int4":
        op = ops.int4_tiled_linear.default
        return lambda x, t: op(x, *t, 128), lambda m: (m.tiles, m.tile_scale, m.tile_min)
    op = ops.int8_tiled_linear.default
    return lambda x, t: op(x, *t, 128), lambda m: (m.tiles, m.scales)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bits", choices=["int4", "int8"], default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--flags", default="", help="extra compiler flags for every build")
    ap.add_argument("--flush-mb", type=int, default=0,
                    help="read this many MB between passes (as projection_bandwidth.py's float32 pass does)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import structkv
    from projection_bandwidth import shapes
    from structkv.models.huge_pages import place_on_huge_pages
    from structkv.models.quantized import QuantizedLinear

    config = structkv.load(a.model).config  # the shapes only
    g = torch.Generator().manual_seed(0)
    holder = torch.nn.Module()
    for i, (o, k) in enumerate(s for _ in range(config.num_layers) for s in shapes(config)):
        holder.add_module(f"m{i}", QuantizedLinear.from_weight(torch.randn(o, k, generator=g) * 0.02, a.bits,
                                                               layout="tiled"))
    place_on_huge_pages(holder, (torch.nn.Module,))
    mods = list(holder.children())
    rows = {m.in_features: torch.randn(1, m.in_features, generator=g) for m in mods}
    keep = [build(s, f"structkv_variant{j}", a.flags.split()) for j, s in enumerate(a.sources)]
    runs = []
    for j, s in enumerate(a.sources):
        run, tensors = product(f"structkv_variant{j}", a.bits)
        stored = [(rows[m.in_features], tensors(m)) for m in mods]
        for m, (x, t) in zip(mods[:7], stored[:7]):  # every build computes the product of its codes
            ref = x @ m.dequantize().t()
            err = float((run(x, t) - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, f"{s}: relative error {err:.1e} against the float product of the codes"
        runs.append((run, stored))
    times = [[] for _ in runs]
    flush = torch.ones(a.flush_mb * 2**18) if a.flush_mb else None  # float32: MB * 2^20 / 4
    for r in range(a.rounds + 2):  # two warm rounds
        for j, (run, stored) in enumerate(runs):
            if flush is not None:
                flush.sum()
            t0 = time.perf_counter()
            for x, t in stored:
                run(x, t)
            if r >= 2:
                times[j].append(time.perf_counter() - t0)
    nbytes = sum(sum(t.numel() * t.element_size() for t in m.buffers()) for m in mods)
    print(f"{a.model} {a.bits}: {len(mods)} products a pass, {nbytes / 1e6:.1f} MB, {a.threads} thread(s), "
          f"flags '{a.flags}', median of {a.rounds} alternated rounds\n")
    print("| build | ms per pass | GB/s | fastest pass ms |\n|---|---|---|---|")
    for s, t in zip(a.sources, times):
        med = statistics.median(t)
        print(f"| {s} | {med * 1e3:.3f} | {nbytes / med / 1e9:.1f} | {min(t) * 1e3:.3f} |")
    del keep


if __name__ == "__main__":
    main()
