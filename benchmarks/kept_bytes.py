"""Kept KV bytes of every run in an eval folder, measured or planned.

Records written before kept bytes were (`kv_bytes_kept`) cannot show what their methods kept. For
methods without propagation (full, StreamingLLM, SnapKV, PyramidKV, H2O) the kept entries follow
from the prompt length alone (`planned_kv_entries` below), so this recomputes them from each
record's `prompt_tokens` and the folder's model config. Where a record has the measured value too,
the two are compared (they must be equal: the planned count is tested against `compress`).

    python benchmarks/kept_bytes.py research/results/longbench_8k [--common]
    python benchmarks/kept_bytes.py research/results/longbench_8k_equal_kept research/results/longbench_8k \
        --labels structkv@0.16,snapkv@0.1 --common

(predictions.jsonl of `structkv eval`, or records.jsonl of `structkv eval fidelity`; several folders
made with the same settings read as one, as in common_subset.py.)

Prints per run label: records, mean kept MiB measured (when every record has it), mean kept MiB
planned (when the method's count is length-determined), and how many of the records that
have both disagree.
Loads the model named in config.json (for its config and dtype).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import structkv
from structkv import methods
from structkv.harness.eval.folders import prompt_key, runs


def planned_kv_entries(method, cfg, length: int) -> list[int] | None:
    """Entries a `length`-token prompt keeps per layer (summed over KV heads) under `method` on a
    model of config `cfg`, when the plan alone fixes them: every token reaches every layer (no
    propagation), so planned layers keep their budget, sliding layers their window, the others
    every token. None when a propagation makes the count depend on the content (FastKV, StructKV,
    GemFilter). Tested equal to what `compress` keeps (tests/test_methods.py)."""
    lengths = torch.tensor([length])
    if method.propagation(cfg, lengths) is not None:
        return None
    plan = method.kv_plan(cfg, lengths)
    return [min(plan[i][0] if i in plan else length, length, cfg.sliding_window_at(i) or length) * cfg.num_kv_heads
            for i in range(cfg.num_layers)]


def method_of(record: dict):
    return methods.build(record["method"], kv=record.get("kv_budget"), struct=record.get("struct_budget"))


def render(by: dict[str, list[dict]], cfg, per_entry: int, common: bool) -> str:
    """The table of kept MiB for runs read by `folders.runs` (label -> records)."""
    if common:  # only the prompts every run has, as benchmarks/common_subset.py compares them
        keys = set.intersection(*({prompt_key(r) for r in recs} for recs in by.values()))
        by = {label: [r for r in recs if prompt_key(r) in keys] for label, recs in by.items()}
    lines = ["| run | records | KV MiB kept (measured) | KV MiB kept (planned) | planned != measured |",
             "|---|---|---|---|---|"]
    for label in sorted(by):
        recs, method = by[label], method_of(by[label][0])
        planned = [planned_kv_entries(method, cfg, r["prompt_tokens"]) for r in recs]
        planned = None if None in planned else [sum(p) * per_entry for p in planned]
        measured = [r.get("kv_bytes_kept") for r in recs]
        pairs = [] if planned is None else [(m, p) for m, p in zip(measured, planned) if m is not None]
        check = f"{sum(m != p for m, p in pairs)} of {len(pairs)}" if pairs else "-"
        measured = None if None in measured else measured
        lines.append(f"| {label} | {len(recs)} | {mib(measured)} | {mib(planned)} | {check} |")
    return "\n".join(lines) + "\n"


def mib(values) -> str:
    return "-" if values is None else f"{sum(values) / len(values) / 2**20:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--common", action="store_true", help="only the prompts every run has (a partial folder)")
    p.add_argument("--labels", default=None, help="comma-separated runs (default: every run in the folders)")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    try:
        by = {label: list(recs.values()) for label, recs in runs(args.folders, labels).items()}
        # runs() has checked that every folder has a config.json made with the same settings
        model = structkv.load(json.loads((args.folders[0] / "config.json").read_text())["config"]["model"])
        per_entry = 2 * model.config.head_dim * model.dtype.itemsize  # K and V of one token, one KV head
        print(render(by, model.config, per_entry, args.common), end="")
    except ValueError as e:
        print(f"kept_bytes: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
