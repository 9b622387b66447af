"""The compress-once default, chosen by the criterion written before any confirmation run
(research/results/README.md, "Ask-time recall"): a candidate's score is its *worst* share of the full
cache over the development folders; the highest wins; within `--tie` of share the smaller hot set
wins, then the smaller recall budget, none first (cheaper per question).

Each folder is read over the prompts every candidate and the full cache have (a folder's full
cache is its own reference), so a partial folder still compares like with like.

    python research/experiments/default_criterion.py research/results/many_dev_gemma_4k \
        research/results/many_dev_smollm2_2k research/results/many_dev_gemma_longbench_4k
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from structkv.harness.eval.folders import runs

METHODS = "structkv_agnostic,structkv_agnostic_union,structkv_agnostic_recent,keydiff,kvzip"
LABEL = re.compile(r"^(?P<method>[^@]+)@(?P<kv>[0-9.]+)(\+recall(?P<recall>[0-9.]+))?$")


def candidates(methods: list[str], budgets: list[str], recalls: list[str], bare: bool = True) -> list[str]:
    """Every method at every hot budget, without recall (`bare`) and with each recall budget."""
    extras = ([""] if bare else []) + [f"+recall{r}" for r in recalls]
    return [f"{m}@{b}{extra}" for m in methods for b in budgets for extra in extras]


def shares(folder: Path, labels: list[str]) -> dict[str, float]:
    """label -> its score over the full cache's, over the prompts every label has in `folder`."""
    by = runs([folder], ["full", *labels])
    common = set.intersection(*(set(v) for v in by.values()))
    if not common:
        raise ValueError(f"{folder}: no prompt is shared by every candidate and the full cache")
    mean = {k: sum(by[k][p]["score"] for p in common) / len(common) for k in by}
    if mean["full"] <= 0:
        raise ValueError(f"{folder}: the full cache scores 0 on the common prompts; no share is defined")
    return {k: mean[k] / mean["full"] for k in labels} | {"_prompts": len(common), "_full": 100 * mean["full"]}


def rank(worst: dict[str, float], tie: float) -> list[str]:
    """Labels best first: worst share, then within `tie` the smaller hot set, then the smaller
    recall budget (none first)."""
    best = max(worst.values())
    near = [k for k in worst if worst[k] >= best - tie]

    def cost(label: str) -> tuple:
        m = LABEL.match(label)
        return float(m["kv"]), float(m["recall"] or 0), -worst[label]
    return sorted(near, key=cost) + sorted((k for k in worst if k not in near), key=lambda k: -worst[k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--kv-budget", default="0.1,0.2")
    ap.add_argument("--recall", default="0.1", help="recall budgets, comma-separated")
    ap.add_argument("--no-bare", action="store_true", help="leave out the candidates without recall")
    ap.add_argument("--tie", type=float, default=0.03, help="share within which cost decides")
    a = ap.parse_args()
    labels = candidates(a.methods.split(","), a.kv_budget.split(","), a.recall.split(","), not a.no_bare)
    per = {f: shares(f, labels) for f in a.folders}
    worst = {k: min(per[f][k] for f in a.folders) for k in labels}
    order = rank(worst, a.tie)
    names = [f.name for f in a.folders]
    print("| rank | candidate | " + " | ".join(f"{n} ({per[f]['_prompts']}, full {per[f]['_full']:.1f})"
                                              for n, f in zip(names, a.folders)) + " | worst share |")
    print("|" + "---|" * (3 + len(names)))
    for i, k in enumerate(order, 1):
        cells = " | ".join(f"{per[f][k]:.2f}" for f in a.folders)
        score = f"**{worst[k]:.2f}**" if i == 1 else f"{worst[k]:.2f}"
        print(f"| {i} | `{k}` | {cells} | {score} |")


if __name__ == "__main__":
    main()
