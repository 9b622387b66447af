"""Scores of a partial eval folder over the prompts every method run has, so rows compare.

A resumed run computes each prompt for every method at once, but a folder extended with new
methods (or stopped midway) holds rows over different prompts; `summary.md` averages each row
over its own. This prints per task and on average, x100, only over the (task, sample) pairs that
every label in the folder (or in `--labels`) has. Several folders made with the same settings
(an equal-kept-bytes run kept apart from the main one) read as one; a label in two folders is
refused.

    python benchmarks/common_subset.py research/results/smollm2_ruler_2k
    python benchmarks/common_subset.py research/results/longbench_8k_equal_kept research/results/longbench_8k \
        --labels structkv@0.16,pyramidkv@0.1,snapkv@0.1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from structkv.harness.eval.folders import runs


def table(folders: list[Path], labels: list[str] | None = None) -> str:
    by = runs(folders, labels)
    labels = labels or sorted(by)
    common = set.intersection(*(set(by[label]) for label in labels))
    if not common:
        return "no prompt is shared by every label\n"
    tasks = sorted({(n, t) for n, t, _ in common})
    head = ["method", "length", *[t for _, t in tasks], "avg", "prompts", "prefill frac", "KV MiB kept"]
    lines = [f"Over the {len(common)} prompts every one of {len(labels)} runs has.\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        rows = [by[label][k] for k in sorted(common)]
        per = [100 * sum(by[label][k]["score"] for k in common if k[:2] == nt) / sum(1 for k in common if k[:2] == nt)
               for nt in tasks]
        kept = [r.get("kv_bytes_kept") for r in rows]
        mib = "-" if None in kept else f"{sum(kept) / len(kept) / 2**20:.2f}"
        fracs = [r.get("prefill_fraction") for r in rows]  # a peer's folder (kvpress) has none
        frac = "-" if None in fracs else f"{sum(fracs) / len(fracs):.2f}"
        lines.append(f"| {label} | {tasks[0][0]} | " + " | ".join(f"{v:.1f}" for v in per)
                     + f" | {sum(per) / len(per):.1f} | {len(rows)} | {frac} | {mib} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--labels", default=None, help="comma-separated labels (default: every label in the folders)")
    args = p.parse_args(argv)
    try:
        print(table(args.folders, args.labels.split(",") if args.labels else None), end="")
    except ValueError as e:
        print(f"common_subset: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
