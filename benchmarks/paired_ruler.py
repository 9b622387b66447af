"""Paired differences between two methods of one eval folder, with bootstrap intervals.

The table's average is a mean over tasks of each task's mean score; with 10 prompts per task one
prompt moves a task by 10 points, so a difference of a point or two needs an interval. This pairs
the two runs prompt by prompt (the same prompts: same task, same sample), resamples prompts within
each task, and reports the difference of the task-averaged scores (x100) with its 95 % interval.

    python benchmarks/paired_ruler.py research/results/smollm2_ruler_4k --method structkv \\
        --against fastkv,snapkv,pyramidkv

Compares at every R_KV the folder holds (`structkv@0.1` against `fastkv@0.1`, ...); a folder with
several lengths is averaged over its (length, task) pairs. Runs at different R_KV (an equal-kept-bytes
run kept in its own folder) pair by exact labels, the baselines read from `--against-folder`, whose
settings must match (the runner's identity fields; `weights` and `kv_dtype` may differ: then the
same prompts through a model stored two ways are what is compared):

    python benchmarks/paired_ruler.py research/results/longbench_8k_equal_kept --method structkv@0.16 \
        --against pyramidkv@0.1,snapkv@0.1 --against-folder research/results/longbench_8k
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

from structkv.harness.eval.folders import runs, settings_clash

# Identity settings that may differ between the two folders: how the model's weights and KV
# entries are stored (the prompts are the same; the difference is what is measured).
STORAGE = ("weights", "kv_dtype")


def scores(folder: Path) -> dict[str, dict[tuple, float]]:
    """label -> {(length, task, sample): score}."""
    return {label: {k: r["score"] for k, r in recs.items()} for label, recs in runs([folder]).items()}


def comparisons(by: dict, other: dict, method: str, against: list[str]) -> list[tuple[str, str]]:
    """(label, baseline label) pairs: exact labels where `method` names an R_KV, else per R_KV."""
    if "@" in method:
        return [(method, b) for b in against if b in other]
    budgets = sorted(label.split("@", 1)[1] for label in by if label.startswith(method + "@"))
    return [(f"{method}@{r}", b if "@" in b else f"{b}@{r}") for r in budgets for b in against
            if (b if "@" in b else f"{b}@{r}") in other]


def task_mean(diffs: dict[tuple, list[float]]) -> float:
    return 100 * sum(sum(v) / len(v) for v in diffs.values()) / len(diffs)


def paired(a: dict, b: dict, resamples: int, rng: random.Random) -> tuple[float, float, float, int]:
    """Difference a - b of the task-averaged scores over their common prompts, and its 95 %
    interval from resampling prompts within each task."""
    by_task: dict[tuple, list[float]] = defaultdict(list)  # (length, task) -> differences
    for key in sorted(set(a) & set(b)):
        by_task[key[:2]].append(a[key] - b[key])
    if by_task and all(len(d) == 1 for d in by_task.values()):
        # One prompt per task: resampling within tasks would give no spread at all (an interval
        # of width 0); the prompts are resampled across tasks instead.
        by_task = {("all", "all"): [d[0] for d in by_task.values()]}
    boots = sorted(task_mean({t: [rng.choice(d) for _ in d] for t, d in by_task.items()})
                   for _ in range(resamples))
    lo, hi = boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]
    return task_mean(by_task), lo, hi, sum(map(len, by_task.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--method", default="structkv", help="a method (every R_KV) or one run, e.g. structkv@0.16")
    p.add_argument("--against", default="fastkv,snapkv", help="comma-separated methods or runs (fastkv@0.1)")
    p.add_argument("--against-folder", type=Path, help="where the baselines' runs are; default: folder")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    other_folder = args.against_folder or args.folder
    try:
        clash = settings_clash(args.folder, other_folder) if other_folder != args.folder else {}
        storage = {k: clash.pop(k) for k in STORAGE if k in clash}
        if clash:
            raise ValueError(f"{args.folder} and {other_folder} were run with other settings {clash}; "
                             "their prompts do not pair")
        if storage:  # the same prompts through a model stored another way: what is being compared
            print(f"comparing storage: {storage} (this folder, the other)")
        by = scores(args.folder)
        other = by if other_folder == args.folder else scores(other_folder)
    except ValueError as e:
        print(f"paired_ruler: {e}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    pairs = [(a, b) for a, b in comparisons(by, other, args.method, args.against.split(",")) if a in by]
    if not pairs:
        print(f"nothing to compare: runs in {args.folder}: {', '.join(sorted(by))}; "
              f"in {other_folder}: {', '.join(sorted(other))}", file=sys.stderr)
        return 2
    print("| R_KV | comparison | difference [95 % interval] | prompts |\n|---|---|---|---|")
    for a, b in pairs:
        if not set(by[a]) & set(other[b]):
            print(f"| {a.split('@', 1)[1]} | {a} - {b} | no prompt in common | 0 |")
            continue
        d, lo, hi, n = paired(by[a], other[b], args.resamples, rng)
        print(f"| {a.split('@', 1)[1]} | {a} - {b} | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
