"""Paired differences between two methods of one eval folder, with bootstrap intervals.

The table's average is a mean over tasks of each task's mean score; with 10 prompts per task one
prompt moves a task by 10 points, so a difference of a point or two needs an interval. This pairs
the two runs prompt by prompt (the same prompts: same task, same sample), resamples prompts within
each task, and reports the difference of the task-averaged scores (x100) with its 95 % interval.

    python benchmarks/paired_ruler.py docs/results/smollm2_ruler_4k --method structkv \\
        --against fastkv,snapkv,pyramidkv

Compares at every R_KV the folder holds (`structkv@0.1` against `fastkv@0.1`, ...); a folder with
several lengths is averaged over its (length, task) pairs.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

from structkv.harness.eval.runner import _read_predictions


def scores(folder: Path) -> dict[str, dict[tuple, float]]:
    """label -> {(length, task, sample): score}."""
    by: dict[str, dict] = defaultdict(dict)
    for r in _read_predictions(folder / "predictions.jsonl").values():
        by[r["label"]][(r["length_budget"], r["task"], r["index"])] = r["score"]
    return by


def task_mean(diffs: dict[tuple, list[float]]) -> float:
    return 100 * sum(sum(v) / len(v) for v in diffs.values()) / len(diffs)


def paired(a: dict, b: dict, resamples: int, rng: random.Random) -> tuple[float, float, float, int]:
    """Difference a - b of the task-averaged scores over their common prompts, and its 95 %
    interval from resampling prompts within each task."""
    by_task: dict[tuple, list[float]] = defaultdict(list)  # (length, task) -> differences
    for key in sorted(set(a) & set(b)):
        by_task[key[:2]].append(a[key] - b[key])
    boots = sorted(task_mean({t: [rng.choice(d) for _ in d] for t, d in by_task.items()})
                   for _ in range(resamples))
    lo, hi = boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]
    return task_mean(by_task), lo, hi, sum(map(len, by_task.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--method", default="structkv")
    p.add_argument("--against", default="fastkv,snapkv", help="comma-separated methods")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    by, rng = scores(args.folder), random.Random(args.seed)
    budgets = sorted(label.split("@", 1)[1] for label in by if label.startswith(args.method + "@"))
    if not budgets:
        print(f"no run of {args.method!r} in {args.folder}; runs: {', '.join(sorted(by))}", file=sys.stderr)
        return 2
    print("| R_KV | comparison | difference [95 % interval] | prompts |\n|---|---|---|---|")
    for budget in budgets:
        for other in args.against.split(","):
            a, b = f"{args.method}@{budget}", f"{other}@{budget}"
            if b not in by:
                continue
            d, lo, hi, n = paired(by[a], by[b], args.resamples, rng)
            print(f"| {budget} | {a} - {b} | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
