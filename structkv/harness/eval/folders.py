"""Reading finished result folders together: runs by label, prompts by key, and whether two folders
pair (made with the same identity settings, so the same key means the same prompt and scoring)."""
from __future__ import annotations

from pathlib import Path

from .config import IDENTITY
from .result_folder import identity, read_predictions, stored_config


def settings_clash(a: Path, b: Path) -> dict[str, tuple]:
    """The identity settings in which two result folders differ ({} when their results mean the same
    thing and prompts pair across them); a key older folders lack counts as its default."""
    ia, ib = identity(stored_config(a)), identity(stored_config(b))
    return {k: (ia[k], ib[k]) for k in IDENTITY if ia[k] != ib[k]}


def prompt_key(record: dict) -> tuple:
    """(length, task, sample): the same prompt in every run of folders that pair."""
    return record.get("length_budget"), record["task"], record["index"]


def runs(folders: list[Path], labels: list[str] | None = None) -> dict[str, dict[tuple, dict]]:
    """label -> {prompt key: record} over folders that pair (only `labels` where given). Raises
    ValueError naming the problem: folders made with other settings, a run in two folders, a label
    in none."""
    by: dict[str, dict] = {}
    for folder in folders:
        if clash := settings_clash(folders[0], folder):
            raise ValueError(f"{folders[0]} and {folder} were run with other settings {clash}")
        path = next((folder / n for n in ("predictions.jsonl", "records.jsonl") if (folder / n).exists()), None)
        if path is None:
            raise ValueError(f"{folder} holds no predictions.jsonl (nor a fidelity records.jsonl)")
        here: dict[str, dict] = {}
        for r in read_predictions(path).values():
            if labels is None or r["label"] in labels:
                here.setdefault(r["label"], {})[prompt_key(r)] = r
        if twice := set(here) & set(by):
            raise ValueError(f"runs {sorted(twice)} are in {folder} and in an earlier folder; choose with --labels")
        by |= here
    if missing := [label for label in labels or [] if label not in by]:
        raise ValueError(f"no run {missing} in {', '.join(map(str, folders))}")
    return by
