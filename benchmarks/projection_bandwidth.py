"""Achieved weight bandwidth of one decode row through every projection of a model, per kernel.

A decode step reads each projection's weight once for one row of activations, so its speed is
weight bytes / time: the measure issue 49 sets ("the projections' achieved GB/s within 70 % of the
float32 path's"). Every candidate runs over the model's real shapes, all layers' weights in turn
(larger than the caches, as in decode), one thread or `--threads`, alternated round by round so
each sees the same minutes of the machine; printed per candidate: the median time of one pass
over all projections, the bytes read, GB/s and the ratio to the float32 path's GB/s.

Candidates: `float32` (W @ x^T, the decoder's few-row path), `bf16` (F.linear on bf16 weights),
`int8_packed` (torch's `_weight_int8pack_mm`, eager), `int8_fused` (structkv's reduction compiled
by inductor: the compiled decode step's path), `int4_packed` (`_weight_int4pack_mm_for_cpu`).
The weights are random (the bandwidth does not depend on the values).

    python benchmarks/projection_bandwidth.py --model smollm2 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections: q, k, v, o, gate, up, down."""
    E, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * D, config.num_kv_heads * D
    return [(q, E), (kv, E), (kv, E), (E, q), (I, E), (I, E), (E, I)]


def build(kind: str, weights: list[torch.Tensor]):
    """The stored form of every weight for `kind`, and one row's product through one of them."""
    from structkv.models.linear import skinny
    from structkv.models.quantized import QuantizedLinear
    from structkv.ops.quantized_linear import int8_row_fused

    if kind == "float32":
        return weights, lambda x, w: skinny(x, w)
    if kind == "bf16":
        return [w.to(torch.bfloat16) for w in weights], lambda x, w: F.linear(x.to(torch.bfloat16), w)
    mods = [QuantizedLinear.from_weight(w, "int8" if kind.startswith("int8") else "int4") for w in weights]
    if kind == "int8_packed":
        return mods, lambda x, m: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), m.codes, m.scales)
    if kind == "int8_fused":  # compiled as the decode step is: every product in one graph (`one_pass`)
        return mods, lambda x, m: int8_row_fused(x, m.codes, m.scales)
    return mods, lambda x, m: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), m.packed, 32, m.scale_zero)


def nbytes(stored) -> int:
    return sum(s.numel() * s.element_size() if isinstance(s, torch.Tensor) else s.nbytes() for s in stored)


def runner(kind: str, stored, product):
    """One pass over every weight: eager, or for `int8_fused` one compiled graph (its products
    are inductor loops, as inside the compiled decode step; a graph per product would time the
    guards)."""
    def run(rows: dict):
        return [product(rows[_in(s)], s) for s in stored]
    return torch.compile(run, dynamic=False) if kind == "int8_fused" else run


def one_pass(run, rows: dict) -> float:
    t0 = time.perf_counter()
    run(rows)
    return time.perf_counter() - t0


def _in(s) -> int:
    return s.shape[1] if isinstance(s, torch.Tensor) else s.in_features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kinds", default="float32,bf16,int8_packed,int8_fused,int4_packed")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import structkv

    config = structkv.load(a.model).config  # the shapes only
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(config.num_layers) for o, i in shapes(config)]
    rows = {i: torch.randn(1, i, generator=g) for i in {w.shape[1] for w in weights}}
    built = {k: build(k, weights) for k in a.kinds.split(",")}
    runs = {k: runner(k, *built[k]) for k in built}
    times = {k: [] for k in built}
    for _ in range(2):  # warm: compiles, page-in
        for k in built:
            one_pass(runs[k], rows)
    for _ in range(a.rounds):
        for k in built:
            times[k].append(one_pass(runs[k], rows))
    print(f"{a.model}: {config.num_layers} layers x 7 projections, one row, {a.threads} thread(s), "
          f"median of {a.rounds} alternated rounds\n")
    print("| kernel | ms per pass | weight MB | GB/s | of float32's GB/s |")
    print("|---|---|---|---|---|")
    base = None
    for k, (stored, _) in built.items():
        t = statistics.median(times[k])
        gbs = nbytes(stored) / t / 1e9
        base = base or (gbs if k == "float32" else None)
        share = f"{gbs / base:.2f}" if base else "-"
        print(f"| {k} | {t * 1e3:.2f} | {nbytes(stored) / 1e6:.1f} | {gbs:.1f} | {share} |")


if __name__ == "__main__":
    main()
