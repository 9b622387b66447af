"""The compiled decode step's own cost, A/B in one process: fused projections and size asserts.

Four copies of one model decode in turn (round robin, so the machine's drift falls on all of
them): q/k/v and gate/up as separate products or fused (`structkv.models.quantized.fuse_projections`),
each with inductor's per-call size asserts on or off (`structkv.runtime.decoding.DECODE_INDUCTOR`).
Every round generates `--new-tokens` after the same `--length`-token prompt with each copy; the
table gives each copy's median decode tokens/s and its ratio to the first (the previous default:
separate products, asserts on), with the per-round ratios' median.

    python research/experiments/decode_step_ab.py --model smollm2 --weights int4 --kv-dtype bf16 --length 1024 \
        --rounds 9 --out research/results/bench/decode_step_ab_smollm2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

VARIANTS = (("separate", True), ("separate", False), ("fused", True), ("fused", False))


def label(variant) -> str:
    products, asserts = variant
    return f"{products} products, size asserts {'on' if asserts else 'off'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    import structkv
    from structkv.harness.bench import prompt_ids
    from structkv.models.quantized import quantize_model
    from structkv.runtime import decoding, generation
    from structkv.util.files import write_text_atomic

    torch.set_num_threads(args.threads)
    models = {}
    for variant in VARIANTS:
        model = structkv.load(args.model, kv_dtype=args.kv_dtype)
        quantize_model(model, args.weights, fuse=variant[0] == "fused")
        models[variant] = model
    ids = prompt_ids(models[VARIANTS[0]], args.length, 0)
    real_step = generation.step_function

    def run(variant) -> float:
        options = {"size_asserts": variant[1]}
        generation.step_function = lambda backend, rows_vary=False: decoding.compiled_decode(backend, options)
        try:
            return generate(models[variant], ids)
        finally:
            generation.step_function = real_step

    def generate(model, prompt) -> float:
        out = structkv.generate(model, prompt, max_new_tokens=args.new_tokens, stop_at_eos=False, compile=True,
                                timing=True)
        return out.stats["decode_tokens_per_s"]

    for variant in VARIANTS:  # compile and warm each copy
        run(variant)
    speeds = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            speeds[variant].append(run(variant))
        print(f"round {r + 1}: " + ", ".join(f"{s[-1]:.1f}" for s in speeds.values()), flush=True)
    base = speeds[VARIANTS[0]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Decode step A/B: {args.model}, {args.weights} weights, KV {args.kv_dtype}, "
             f"{args.length}-token prompt, {args.threads} threads", "",
             f"Command: `python research/experiments/decode_step_ab.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| decode step | tok/s (median) | ratio to the first, per round: median [min, max] |", "|---|---|---|"]
    for variant, s in speeds.items():
        ratios = [a / b for a, b in zip(s, base)]
        lines.append(f"| {label(variant)} | {statistics.median(s):.1f} | {statistics.median(ratios):.2f} "
                     f"[{min(ratios):.2f}, {max(ratios):.2f}] |")
    write_text_atomic(out / "README.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "speeds.json", json.dumps({label(v): s for v, s in speeds.items()}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
