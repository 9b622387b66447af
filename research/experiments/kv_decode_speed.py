"""Decode speed with quantized KV entries, side by side in one run: the same prompt and method
decoded from float, int8 and int4 entries, alternating settings every repeat (median of repeats),
with the KV bytes each keeps. On CPU every cache reads its entries through the decode kernel
(`structkv::cpu_decode_attention`, codes dequantized row by row; SDPA over a dequantized copy
where the kernel is not built), on CUDA through the Triton kernel, so this says what the smaller
cache gains or costs in speed.

    python research/experiments/kv_decode_speed.py --model gemma-3-270m --weights int8 --length 4096 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--methods", default="full,structkv")
    ap.add_argument("--kv-budget", default="0.1")
    ap.add_argument("--kv-dtypes", default="none,int8,int4")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    import structkv
    from structkv import methods

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model, weights=args.weights)
    ids = torch.randint(1000, 20000, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    settings = [None if k == "none" else k for k in args.kv_dtypes.split(",")]
    names = args.methods.split(",")
    speed = {(k, n): [] for k in settings for n in names}
    kept = {}
    for r in range(args.repeats + 1):  # the first round compiles every decode graph: not counted
        for name in names:
            for kv in settings:
                model.kv_dtype = kv
                state = structkv.prefill(model, ids, methods.build(name, kv=args.kv_budget), room=args.new_tokens + 8)
                out = structkv.generate(model, [1], state=state, max_new_tokens=args.new_tokens, compile=True,
                                        stop_at_eos=False)
                kept[(kv, name)] = sum(layer.entry_bytes() * layer.entries() for layer in state.cache.layers)
                if r:
                    speed[(kv, name)].append(out.stats["decode_tokens_per_s"])
    model.kv_dtype = None
    base = {n: statistics.median(speed[(None, n)]) for n in names}
    print(f"| {args.model}, {args.weights} weights, {args.length} tokens | KV entries | decode tokens/s | "
          f"vs float entries | KV MiB kept |")
    print("|---|---|---|---|---|")
    for (kv, name), values in speed.items():
        med = statistics.median(values)
        print(json.dumps({"method": name, "kv_dtype": kv, "decode_tokens_per_s": values}), file=sys.stderr)
        print(f"| {name} | {kv or 'float32'} | {med:.1f} | {med / base[name]:.2f}x | {kept[(kv, name)] / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
