"""float32 against bfloat16 batched products at recall's archive-tile shapes, one process.

Ask-time recall multiplies a question's rows (G*S: query heads x question tokens) by archive tiles
of `structkv.modules.recall.TILE` entries per KV head; this times both of its products (Q K^T and
P V) in each dtype and prints GFLOP/s, which is what `RecallLayer.work_dtype` rests on.

    python research/experiments/bf16_products.py --heads 3 --rows 117 --dim 64 --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch


def rate(fn, flops: float, repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return flops * repeats / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    p.add_argument("--rows", type=int, default=117, help="query heads per KV head x question tokens")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flops = 2.0 * a.heads * a.rows * a.dim * a.tile
    print("| dtype | Q K^T GFLOP/s | P V GFLOP/s |\n|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(a.heads, a.rows, a.dim, dtype=dtype), torch.randn(a.heads, a.dim, a.tile, dtype=dtype)
        p_, v = torch.randn(a.heads, a.rows, a.tile, dtype=dtype), torch.randn(a.heads, a.tile, a.dim, dtype=dtype)
        print(f"| {dtype} | {rate(lambda: q @ k, flops, a.repeats):.1f} | "
              f"{rate(lambda: torch.bmm(p_, v), flops, a.repeats):.1f} |")


if __name__ == "__main__":
    main()
