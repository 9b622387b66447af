"""The leaderboard: the accuracy tables of a set of eval folders, generated, never typed.

One table per folder and length (a folder is one set of prompts: the benchmark, the model and the
setting, the question inside the compressed prompt or asked after it), methods down, R_KV budgets
across; each cell is the folder's average score
for that method and budget, linked to the folder's summary, and marked when the folder is still
partial (not every prompt scored for every run). The page records the command that made it, so
`tests/test_leaderboard.py` can regenerate it from the folders and fail when they disagree.

    python -m structkv.harness.eval.leaderboard research/results/ruler_4k ... --out docs/results.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from .result_folder import stored_config

TITLE = "# Results: the leaderboard"
INTRO = ("Generated from the eval folders named in the command below; do not edit by hand (a test "
         "regenerates it). A cell is the average score (0-100) over the folder's prompts for that "
         "method and R_KV (the full cache keeps everything: its score stands in every column); `*`: "
         "the folder is partial (not every prompt scored yet); `+recall r`: "
         "the context compressed before the question, then the question recalls r of it from the "
         "archive. How each folder was made (its command, machine and date) is in its `config.json`.")


def read_folder(folder: Path) -> dict:
    """A folder's config (`config.json`'s "config") and its rows (`metrics.json`'s "rows")."""
    try:
        config = stored_config(folder)
        rows = json.loads((folder / "metrics.json").read_text())["rows"]
    except (OSError, KeyError, ValueError) as e:  # a JSONDecodeError is a ValueError
        raise ValueError(f"{folder} is not a complete eval folder (config.json and metrics.json): {e}") from None
    return {"config": config, "rows": rows}


def _method(label: str) -> str:
    """A row's method without its budget: "snapkv@0.1+recall0.2" -> "snapkv +recall 0.2"."""
    name, _, rest = label.partition("@")
    recall = rest.partition("+recall")[2]
    return f"{name} +recall {recall}" if recall else name


def _partial(folder: Path) -> bool:
    """Whether the folder says it is partial: its summary's title, written by the eval that knows
    how many prompts each run was asked."""
    try:
        first = (folder / "summary.md").read_text().split("\n", 1)[0]
    except OSError:
        return False
    return "not all scored yet" in first


def _key(folder: Path, config: dict, length: int) -> tuple:
    setting = "question after the compressed context" if config.get("question_after") else "question inside"
    return config["benchmark"], config["model"], length, setting, folder.name


def tables(folders: list[Path], page: Path) -> list[str]:
    """The markdown of every table, in the folders' order of first appearance."""
    groups: dict[tuple, list[tuple[Path, dict]]] = defaultdict(list)
    for folder in folders:
        data = read_folder(folder)
        for length in data["config"]["lengths"]:
            rows = [r for r in data["rows"] if r.get("length") == length]
            groups[_key(folder, data["config"], length)].append((folder, rows))
    return [_table(*key, parts, page) for key, parts in groups.items()]


def _table(bench, model, length, setting, name, parts, page: Path) -> str:
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    budgets: list[str] = []
    for folder, rows in parts:
        link = Path(os.path.relpath(folder / "summary.md", page.parent)).as_posix()
        star = "*" if _partial(folder) else ""
        for r in rows:
            budget = "-" if r.get("kv_budget") is None else f"{r['kv_budget']:g}"
            if budget not in budgets:
                budgets.append(budget)
            cells[_method(r["label"])].setdefault(budget, f"[{r['average']:.1f}{star}]({link})")
    budgets = sorted((b for b in budgets if b != "-"), key=float)
    prompts = max(sum(r.get("n", {}).values()) for _, rows in parts for r in rows)
    head = f"## {bench}, {model}, {length} tokens, {setting}: `{name}` ({prompts} prompts)\n\n"
    lines = ["| method | " + " | ".join(f"R_KV {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method in sorted(cells, key=lambda m: (m != "full", m)):
        row = cells[method]
        values = [row.get("-", "") if "-" in row else row.get(b, "") for b in budgets]  # full: in every column
        lines.append(f"| {method} | " + " | ".join(values) + " |")
    return head + "\n".join(lines) + "\n"


def render(folders: list[Path], page: Path, command: str) -> str:
    return f"{TITLE}\n\n{INTRO}\n\n    {command}\n\n" + "\n".join(tables(folders, page))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="eval folders (config.json, metrics.json, summary.md)")
    p.add_argument("--out", type=Path, required=True, help="the page to write (markdown)")
    args = p.parse_args(argv)
    command = "python -m structkv.harness.eval.leaderboard " + " ".join(
        [f.as_posix() for f in args.folders] + ["--out", args.out.as_posix()])
    try:
        text = render(args.folders, args.out, command)
    except ValueError as e:
        print(f"leaderboard: {e}", file=sys.stderr)
        return 2
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.out)  # never a half-written page
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
