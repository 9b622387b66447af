"""Decode step time with the few-row CPU path of `structkv.models.linear` on and off, side by side.

torch's CPU float32 kernels run x (M, in) @ W^T at a few rows M as matrix-vector products; the
decoder's `Linear` and its LM head compute W @ x^T instead (one row padded to two). This runs the
same decode step (a 1K-token prompt compressed with `structkv` at R_KV 0.1, then one token per row)
for batches of 1, 2, 3, 4 and 8 rows (continuous batching in `structkv serve` stacks requests like
this), eager, and for one row compiled (`structkv generate`'s step), alternating off / on.

    python research/experiments/skinny_linear.py --model gemma-3-270m --threads 2
"""
from __future__ import annotations

import argparse
import time


def step_ms(model, cache, tokens, positions, decode, repeats: int) -> float:
    for i in range(3):
        decode(model, tokens, positions + i, cache)
    t = time.perf_counter()
    for i in range(repeats):
        decode(model, tokens, positions + 3 + i, cache)
    return (time.perf_counter() - t) / repeats * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--batches", default="1,2,3,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled one-row step (two compiles)")
    args = p.parse_args()
    import torch

    import structkv
    from structkv.models import linear
    from structkv.models.kv_cache import StackedKVCache
    from structkv.runtime.decoding import compiled_decode, decode_step
    from structkv.runtime.generation import start

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    first = start(model, list(range(1000, 2024)), max_new_tokens=64, method=structkv.methods.build("structkv", kv=0.1))
    sliding_windows = [model.config.sliding_window_at(i) for i in range(model.config.num_layers)]
    on = (linear.SKINNY_ROWS, linear.HEAD_ROWS)

    def set_path(enabled: bool):
        linear.SKINNY_ROWS, linear.HEAD_ROWS = on if enabled else (0, 0)

    runs = [("eager", b, decode_step) for b in map(int, args.batches.split(","))]
    if not args.no_compiled:
        runs.append(("compiled", 1, compiled_decode("inductor")))
    print(f"{args.model}, float32 weights, {args.threads} threads, decode step after a 1024-token prompt "
          f"(structkv R_KV 0.1), ms per step (mean of {args.repeats} after 3 warm-up steps)\n")
    print("| step | rows | nn.Linear (off) ms | W @ x^T (on) ms | speed-up |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for kind, rows, decode in runs:
            cache = StackedKVCache([first.cache] * rows, room=64, sliding_windows=sliding_windows)
            tokens, positions = torch.full((rows, 1), 5), first.next_pos.repeat(rows, 1)
            times = {}
            for enabled in (False, True):
                set_path(enabled)
                times[enabled] = step_ms(model, cache, tokens, positions, decode, args.repeats)
            print(f"| {kind} | {rows} | {times[False]:.1f} | {times[True]:.1f} | {times[False] / times[True]:.2f}x |",
                  flush=True)
    set_path(True)


if __name__ == "__main__":
    main()
