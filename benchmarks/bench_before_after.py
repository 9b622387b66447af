"""`structkv bench` on two checkouts, alternating, in one run: did a change move prefill or decode?

A refactor claims "no behaviour change"; this measures it. Each round runs the same
`structkv bench` command once per checkout (PYTHONPATH picks the tree), alternating the order
(before, after, after, before, ...) so drift in the machine's load falls on both sides; the
table gives each method's median prefill seconds and decode tokens/s per side and the ratio
after / before.

    python benchmarks/bench_before_after.py --before /path/to/old/checkout --after . --rounds 2 \\
        --out research/results/bench/layout_before_after -- --model gemma-3-270m --lengths 4096 --no-hf

Everything after `--` goes to `structkv bench` as is.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def one_run(tree: Path, bench_args: list[str], out: Path) -> list[dict]:
    """One `structkv bench` in `tree`: its rows (method, prefill_s, decode_tokens_per_s, ...)."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, "-m", "structkv.cli", "bench", *bench_args, "--out", str(out.resolve())]
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())["rows"]


def table(runs: dict[str, list[list[dict]]], labels: dict[str, str]) -> str:
    """Markdown: per (tokens, method), medians over rounds and the after / before ratio."""
    def medians(side, key):
        per = {}
        for rows in runs[side]:
            for r in rows:
                v = r[key]
                per.setdefault((r["tokens"], r["method"]), []).append(v["median"] if isinstance(v, dict) else v)
        return {k: statistics.median(v) for k, v in per.items()}

    pre = {s: medians(s, "prefill_s") for s in runs}
    dec = {s: medians(s, "decode_tokens_per_s") for s in runs}
    lines = [f"| tokens | method | prefill s before ({labels['before']}) | after ({labels['after']}) | after / before "
             "| decode tok/s before | after | after / before |", "|---|---|---|---|---|---|---|---|"]
    for key in pre["before"]:
        if key not in pre["after"]:
            continue
        pb, pa, db, da = pre["before"][key], pre["after"][key], dec["before"][key], dec["after"][key]
        lines.append(f"| {key[0]} | {key[1]} | {pb:.3f} | {pa:.3f} | {pa / pb:.3f} | {db:.1f} | {da:.1f} | "
                     f"{da / db:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="checkout measured as 'before'")
    p.add_argument("--after", type=Path, default=Path("."), help="checkout measured as 'after'")
    p.add_argument("--rounds", type=int, default=2, help="runs per checkout (alternating order)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", action="store_true",
                   help="write summary.md from the bench.json files already under --out (no new runs)")
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    for side in ("before", "after"):
        if not (getattr(args, side) / "structkv" / "__init__.py").is_file():
            p.error(f"--{side} {getattr(args, side)} is not a structkv checkout (no structkv/__init__.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before, "after": args.after}
    labels = {side: commit(tree) for side, tree in trees.items()}
    runs = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            print(f"round {i + 1}: {side} ({labels[side]})", file=sys.stderr, flush=True)
            out = args.out / f"{side}_{labels[side]}_r{i + 1}"
            if args.report:
                if not (out / "bench.json").is_file():
                    p.error(f"--report: {out / 'bench.json'} is missing; run without --report to measure it")
                runs[side].append(json.loads((out / "bench.json").read_text())["rows"])
            else:
                runs[side].append(one_run(trees[side], bench_args, out))
    text = (f"# structkv bench, before ({labels['before']}) and after ({labels['after']}), alternating\n\n"
            f"`python benchmarks/bench_before_after.py {' '.join(argv)}`; medians over {args.rounds} run(s) "
            "per side.\n\n" + table(runs, labels) + "\n")
    tmp = args.out / "summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(args.out / "summary.md")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
