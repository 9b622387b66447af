"""Decode speed against llama.cpp as paired ratios: one llama.cpp decode, then one structkv decode
of the same depth, alternated `--pairs` times; the ratio of each adjacent pair, their median and a
bootstrap interval of it.

Why: on a shared machine the memory bandwidth both engines are bound by moves by 10-40 % between
minutes (research/benchmarks_log.md), so a ratio of two medians measured minutes apart can move by more
than the gap it is meant to settle. Adjacent pairs see the same machine; their ratios' median is
what `llama_cpp_side_by_side.py`'s decode column estimates, with a spread.

    python benchmarks/decode_pairs.py --llama-bench $LLAMA_BENCH --model smollm2 --lengths 1024 \
        --weights int8 --kv-dtype int8 --pairs 9 --out research/results/bench/decode_pairs_smollm2
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_cpp_side_by_side import KV_LABELS, LLAMA_KV, gguf_path


def llama_decode(binary: str, gguf: str, threads: int, depth: int, new_tokens: int, kv_dtype) -> float:
    """llama.cpp's decode tokens/s at `depth`, one repetition."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", *LLAMA_KV[kv_dtype],
           "-p", "0", "-n", str(new_tokens), "-d", str(depth)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)[0]["avg_ts"]


def median_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median ratio."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--kv-dtype", default=None, choices=[None, "bf16", "int8", "int4"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    import structkv
    from structkv.harness.bench import prompt_ids
    from structkv.runtime.generation import generate
    from structkv.util.files import write_text_atomic

    torch.set_num_threads(args.threads)
    gguf = gguf_path(args.model)
    model = structkv.load(args.model, weights=args.weights, kv_dtype=args.kv_dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Decode against llama.cpp, paired: {args.model}, {args.threads} threads, {args.weights} weights, "
             f"KV {KV_LABELS[False][args.kv_dtype]} / llama.cpp {KV_LABELS[True][args.kv_dtype]}", "",
             f"Command: `python benchmarks/decode_pairs.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| tokens | pairs | llama.cpp tok/s (median) | structkv tok/s (median) | ratio per pair: median "
             "[95 % bootstrap] | pairs with structkv ahead |", "|---|---|---|---|---|---|"]
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = prompt_ids(model, n, 0)

        def ours() -> float:
            return generate(model, ids, max_new_tokens=args.new_tokens, stop_at_eos=False, compile=True,
                            timing=True).stats["decode_tokens_per_s"]

        ours()  # compile and warm
        pairs = []
        for i in range(args.pairs):
            theirs = llama_decode(args.llama_bench, gguf, args.threads, n, args.new_tokens, args.kv_dtype)
            mine = ours()
            pairs.append((theirs, mine))
            print(f"{n:>6} pair {i}: llama.cpp {theirs:.1f}, structkv {mine:.1f} tok/s ({mine / theirs:.2f}x)",
                  file=sys.stderr, flush=True)
        ratios = [m / t for t, m in pairs]
        lo, hi = median_interval(ratios)
        rows.append({"tokens": n, "pairs": pairs, "ratios": ratios, "median": statistics.median(ratios),
                     "interval": [lo, hi], "started": time.ctime()})
        lines.append(f"| {n} | {len(pairs)} | {statistics.median(t for t, _ in pairs):.1f} | "
                     f"{statistics.median(m for _, m in pairs):.1f} | **{statistics.median(ratios):.2f}x** "
                     f"[{lo:.2f}, {hi:.2f}] | {sum(r > 1 for r in ratios)} of {len(ratios)} |")
    write_text_atomic(out / "pairs.json", json.dumps(rows, indent=1))
    write_text_atomic(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
