"""Achieved weight bandwidth of one decode row through every projection of a model, per kernel.

A decode step reads each projection's weight once for one row of activations, so its speed is
weight bytes / time: the measure issue 49 sets ("the projections' achieved GB/s within 70 % of the
float32 path's"). Every candidate runs over the model's real shapes, all layers' weights in turn
(larger than the caches, as in decode), one thread or `--threads`, alternated round by round so
each sees the same minutes of the machine; printed per candidate: the median time of one pass
over all projections, the bytes read, GB/s and the ratio to the float32 path's GB/s.

Candidates: `float32` (W @ x^T, the decoder's few-row path), `bf16` (F.linear on bf16 weights),
`int8_packed` (torch's `_weight_int8pack_mm`, eager), `int8_fused` (structkv's reduction compiled
by inductor: the compiled decode step's path), `int4_packed` (`_weight_int4pack_mm_for_cpu`),
`int4_fused` (a candidate: int4 codes in a plain layout, `Int4Rows`, dequantized in registers by an
inductor reduction, as `int8_fused` does for int8), `int4_cpp` / `int4_vnni` (the same layout in
`research/experiments/kernels/int4_gemv.cpp`: widened to float, or VPDPBUSD on x quantized per 32, one row at
a time; AVX-512 only), `int4_tiled` / `int8_tiled` (the library's `structkv::int4_tiled_linear`,
`structkv::int8_tiled_linear`: x quantized per 32, integer products vectorised across 16 output
rows, AVX-512 VNNI or AVX2), and
two C++ candidates built here with g++ (`research/experiments/kernels/int8_gemv.cpp`, AVX-512): `int8_cpp`
(codes widened to float in registers) and `int8_vnni` (x quantized per 64 values, VPDPBUSD).
The weights are random (the bandwidth does not depend on the values); each candidate's largest
error against the float product of the same codes is printed (relative to the output's scale).

Every candidate gets its stored tensors as bare tensors (`Plain`) and the library's ops by their
overload (`.default`), as the compiled decode step passes and calls them. `--fused` times the four
products a quantized decoder layer runs (q, k, v as one; gate, up as one) for every candidate.

    python research/experiments/projection_bandwidth.py --model smollm2 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def shapes(config, fused: bool = False) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections: q, k, v, o, gate, up, down; `fused`: qkv, o, gate_up,
    down, the four products a quantized decoder layer runs (`quantized.fuse_projections`)."""
    E, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * D, config.num_kv_heads * D
    if fused:
        return [(q + 2 * kv, E), (E, q), (2 * I, E), (E, I)]
    return [(q, E), (kv, E), (kv, E), (E, q), (I, E), (I, E), (E, I)]


def build(kind: str, weights: list[torch.Tensor], quantized: dict):
    """The stored form of every weight for `kind`, and one row's product through one of them.
    `quantized`: "int8" / "int4" -> the weights quantized once, shared by every kernel of that kind."""
    from structkv.models.linear import skinny
    from structkv.models.quantized import INT4_GROUP, QuantizedLinear
    from structkv.ops.quantized_linear import int8_row_fused

    if kind == "float32":
        return weights, lambda x, w: skinny(x, w)
    if kind == "bf16":
        return [w.to(torch.bfloat16) for w in weights], lambda x, w: F.linear(x.to(torch.bfloat16), w)
    bits = "int8" if kind.startswith("int8") else "int4"
    if bits not in quantized:
        quantized[bits] = [QuantizedLinear.from_weight(w, bits, layout="packed") for w in weights]  # PyTorch's
    mods = quantized[bits]
    if kind == "int8_packed":
        return mods, lambda x, m: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), m.codes, m.scales)
    if kind == "int8_fused":  # compiled as the decode step is: every product in one graph (`one_pass`)
        return mods, lambda x, m: int8_row_fused(x, m.codes, m.scales)
    if kind in ("int8_cpp", "int8_vnni"):
        op = getattr(torch.ops.structkv_bench, "int8_gemv" if kind == "int8_cpp" else "int8_vnni")
        return mods, lambda x, m: op(x, m.codes, m.scales)
    if kind == "int4_tiled":  # the library's kernels (structkv/ops/csrc/tiled_linear.cpp), the same codes
        return ([QuantizedLinear.from_weight(m.dequantize(), "int4", layout="tiled") for m in mods],
                lambda x, m: torch.ops.structkv.int4_tiled_linear.default(x, m.tiles, m.tile_scale, m.tile_min, 128))
    if kind == "int8_tiled":
        return ([QuantizedLinear.from_weight(m.dequantize(), "int8", layout="tiled") for m in mods],
                lambda x, m: torch.ops.structkv.int8_tiled_linear.default(x, m.tiles, m.scales, 128))
    if kind in ("int4_cpp", "int4_vnni"):  # `Int4Rows`' layout read by research/experiments/kernels/int4_gemv.cpp
        op = getattr(torch.ops.structkv_bench4, "int4_gemv" if kind == "int4_cpp" else "int4_vnni")
        return ([Int4Rows(m.dequantize()) for m in mods],
                lambda x, m: op(x, m.codes, m.scale, m.lo))
    if kind == "int4_fused":  # a candidate layout: compiled as the decode step is
        return [Int4Rows(m.dequantize()) for m in mods], lambda x, m: int4_row_fused(x, m.codes, m.scale, m.lo)
    return mods, lambda x, m: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), m.packed, INT4_GROUP, m.scale_zero)


class Int4Rows:
    """A candidate int4 layout for one-row products written as a reduction: codes (N, K/2) uint8,
    per group of 32 columns byte j holding column j (low nibble) and j + 16 (high); bf16 scale
    and minimum (N, K/32), w = code * scale + min. Built from a weight already on a 16-level grid
    (the int4 kernel's), so its codes are the same weights."""

    def __init__(self, w: torch.Tensor):
        N, K = w.shape
        g = w.view(N, K // 32, 32)  # (N, G, 32)
        lo = g.amin(-1)
        scale = ((g.amax(-1) - lo) / 15).clamp_min(1e-12)
        self.scale, self.lo = scale.to(torch.bfloat16), lo.to(torch.bfloat16)
        codes = torch.round((g - self.lo.float()[..., None]) / self.scale.float()[..., None]).clamp(0, 15)
        codes = codes.to(torch.uint8)
        self.codes = (codes[..., :16] | (codes[..., 16:] << 4)).view(N, K // 2)
        self.in_features = K

    def dequantize(self) -> torch.Tensor:
        N = self.codes.shape[0]
        c = self.codes.view(N, -1, 16)
        codes = torch.cat([c & 15, c >> 4], -1).float()  # (N, G, 32)
        return (codes * self.scale.float()[..., None] + self.lo.float()[..., None]).view(N, -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.lo))


def int4_row_fused(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """x (1, K) float32 -> (1, N) over `Int4Rows`' layout: each weight dequantized in registers
    (code * scale + min) and multiplied by x, one reduction over all K per row (a reduction per
    group would end every 16 bytes in a horizontal sum); each byte read once."""
    N, G = scale.shape
    c = codes.view(N, G, 16)
    xg = x.view(1, G, 2, 16)  # (1, G, low/high, 16)
    s, m = scale.float()[..., None], lo.float()[..., None]  # (N, G, 1)
    low = ((c & 15).float() * s + m) * xg[:, :, 0]  # (N, G, 16)
    high = ((c >> 4).float() * s + m) * xg[:, :, 1]
    return (low + high).sum((1, 2))[None]  # (1, N)


def load_cpp(name: str) -> None:
    """Build research/experiments/kernels/<name>.cpp against this torch (about 10 s) and load its ops."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from torch.utils import cpp_extension

    source = Path(__file__).parent / "kernels" / f"{name}.cpp"
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    with tempfile.TemporaryDirectory() as tmp:  # a loaded library stays mapped once its file is gone
        lib = Path(tmp) / f"{name}.so"
        cmd = ["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", abi,
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(lib),
               f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10"]
        subprocess.run(cmd, check=True)
        torch.ops.load_library(str(lib))


def error(kind: str, built, weights, rows) -> float:
    """The largest |candidate - float product of its own stored weight| over the first layer,
    relative to the largest |output|."""
    stored, product = built
    worst = 0.0
    for s, w in zip(stored[:7], weights[:7]):
        x = rows[w.shape[1]]
        ref = x @ (s.dequantize() if not isinstance(s, torch.Tensor) else s.float()).t()
        worst = max(worst, float((product(x, s).float() - ref).abs().max() / ref.abs().max()))
    return worst


def nbytes(stored) -> int:
    return sum(s.numel() * s.element_size() if isinstance(s, torch.Tensor) else s.nbytes() for s in stored)


class Plain:
    """A quantized module's buffers as plain attributes. Why: the decode step's compiled graph takes
    them as inputs, while `module.tiles` costs ~0.7 us through nn.Module's lookup (~2 us a product for
    three tables: ~10 % of an int4 pass), a cost the float32 candidate's bare tensors do not pay."""

    def __init__(self, module: torch.nn.Module):
        self.__dict__.update(dict(module.named_buffers()))
        self.module, self.in_features = module, module.in_features

    def dequantize(self) -> torch.Tensor:
        return self.module.dequantize()

    def nbytes(self) -> int:
        return self.module.nbytes()


def runner(kind: str, stored, product):
    """One pass over every weight: eager, or for `int8_fused` one compiled graph (its products
    are inductor loops, as inside the compiled decode step; a graph per product would time the
    guards)."""
    def run(rows: dict):
        return [product(rows[_in(s)], s) for s in stored]
    return torch.compile(run, dynamic=False) if kind in ("int8_fused", "int4_fused") else run


def one_pass(run, rows: dict) -> float:
    t0 = time.perf_counter()
    run(rows)
    return time.perf_counter() - t0


def _in(s) -> int:
    return s.shape[1] if isinstance(s, torch.Tensor) else s.in_features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kinds", default="float32,bf16,int8_packed,int8_fused,int4_packed,int8_cpp,int8_vnni")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fused", action="store_true",
                   help="q, k, v as one product and gate, up as one, for every candidate (as a quantized "
                        "decoder runs them: 4 products a layer); default: 7 separate products")
    p.add_argument("--huge-pages", choices=["none", "quantized", "all"], default="none",
                   help="put the stored weights on transparent huge pages as the library puts its quantized "
                        "ones (structkv.models.huge_pages): the quantized candidates only, or the float ones too")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import structkv

    config = structkv.load(a.model).config  # the shapes only
    g = torch.Generator().manual_seed(0)
    layer = shapes(config, a.fused)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(config.num_layers) for o, i in layer]
    rows = {i: torch.randn(1, i, generator=g) for i in {w.shape[1] for w in weights}}
    kinds = a.kinds.split(",")
    if {"int8_cpp", "int8_vnni"} & set(kinds):
        load_cpp("int8_gemv")
    if {"int4_cpp", "int4_vnni"} & set(kinds):
        load_cpp("int4_gemv")
    quantized = {}
    built = {k: build(k, weights, quantized) for k in kinds}
    if a.huge_pages != "none":
        from structkv.models.huge_pages import place_on_huge_pages

        for k, (stored, _) in built.items():
            if a.huge_pages == "all" or k not in ("float32", "bf16"):
                holder = torch.nn.Module()  # the stored tensors (or modules' buffers) as one module's
                for i, t in enumerate(stored):
                    if isinstance(t, torch.Tensor):
                        holder.register_buffer(f"w{i}", t)
                    else:
                        holder.add_module(f"m{i}", t)
                moved = place_on_huge_pages(holder, (torch.nn.Module,))
                if isinstance(stored[0], torch.Tensor):
                    stored[:] = [getattr(holder, f"w{i}") for i in range(len(stored))]
                print(f"{k}: {moved / 1e6:.1f} MB on huge pages", flush=True)
    built = {k: ([Plain(s) if isinstance(s, torch.nn.Module) else s for s in stored], product)
             for k, (stored, product) in built.items()}  # after the huge pages: they rebind the buffers
    runs = {k: runner(k, *built[k]) for k in built}
    times = {k: [] for k in built}
    for _ in range(2):  # warm: compiles, page-in
        for k in built:
            one_pass(runs[k], rows)
    for _ in range(a.rounds):
        for k in built:
            times[k].append(one_pass(runs[k], rows))
    print(f"{a.model}: {config.num_layers} layers x {len(layer)} products, one row, {a.threads} thread(s), "
          f"median of {a.rounds} alternated rounds\n")
    print("| kernel | ms per pass | weight MB | GB/s | of float32's GB/s | largest error (relative) |")
    print("|---|---|---|---|---|---|")
    base = None
    for k, (stored, _) in built.items():
        t = statistics.median(times[k])
        gbs = nbytes(stored) / t / 1e9
        base = base or (gbs if k == "float32" else None)
        share = f"{gbs / base:.2f}" if base else "-"
        err = error(k, built[k], weights, rows)
        print(f"| {k} | {t * 1e3:.2f} | {nbytes(stored) / 1e6:.1f} | {gbs:.1f} | {share} | {err:.1e} |")


if __name__ == "__main__":
    main()

