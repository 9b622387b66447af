"""Scores of a partial eval folder over the prompts every method run has, so rows compare.

A resumed run computes each prompt for every method at once, but a folder extended with new
methods (or stopped midway) holds rows over different prompts; `summary.md` averages each row
over its own. This prints per task and on average, x100, only over the (task, sample) pairs that
every label in the folder (or in `--labels`) has.

    python benchmarks/common_subset.py docs/results/smollm2_ruler_2k
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def table(folder: Path, labels: list[str] | None = None) -> str:
    by: dict[str, dict] = defaultdict(dict)
    for line in (folder / "predictions.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by[r["label"]][(r["length_budget"], r["task"], r["index"])] = r
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
        frac = sum(r["prefill_fraction"] for r in rows) / len(rows)
        lines.append(f"| {label} | {tasks[0][0]} | " + " | ".join(f"{v:.1f}" for v in per)
                     + f" | {sum(per) / len(per):.1f} | {len(rows)} | {frac:.2f} | {mib} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--labels", default=None, help="comma-separated labels (default: every label in the folder)")
    args = p.parse_args(argv)
    print(table(args.folder, args.labels.split(",") if args.labels else None), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
