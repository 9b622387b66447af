"""Builds of csrc/tiled_linear.cpp side by side: one pass over every projection of a model (7 a
layer, one decode row, the weights quantized once and shared) through each build, alternated round
by round; the median ms a pass and its GB/s.

Why: a change inside the int4 / int8 kernels (a prefetch, an unrolling) moves a pass by a few
percent, less than a shared machine drifts between two runs; builds loaded into one process and
alternated see the same minutes. Each source is built as the library builds its own (plus `--flags`,
e.g. `-mno-avx512f` for the AVX2 path on an AVX-512 machine) under its own op namespace
(`tiled_linear.build_variant`), checked against the float product of its codes, then timed. The
weights are random (the time does not depend on the values) and placed on huge pages as
`quantize_model` places them.

    git show HEAD~1:structkv/ops/csrc/tiled_linear.cpp > /tmp/before.cpp
    python research/experiments/tiled_variants.py /tmp/before.cpp structkv/ops/csrc/tiled_linear.cpp --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


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
    from projection_bandwidth import shapes

    import structkv
    from structkv.models.huge_pages import place_on_huge_pages
    from structkv.models.quantized import QuantizedLinear
    from structkv.ops.tiled_linear import build_variant

    config = structkv.load(a.model).config  # the shapes only
    g = torch.Generator().manual_seed(0)
    holder = torch.nn.Module()
    for i, (o, k) in enumerate(s for _ in range(config.num_layers) for s in shapes(config)):
        holder.add_module(f"m{i}", QuantizedLinear.from_weight(torch.randn(o, k, generator=g) * 0.02, a.bits,
                                                               layout="tiled"))
    place_on_huge_pages(holder, (torch.nn.Module,))
    mods = list(holder.children())
    rows = {m.in_features: torch.randn(1, m.in_features, generator=g) for m in mods}
    keep = [build_variant(f"structkv_variant{j}", a.flags.split(), Path(s))[0] for j, s in enumerate(a.sources)]
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
