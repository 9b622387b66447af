"""Choosing StructKV's settings on the development split: the fidelity metric and RULER accuracy.

Every configuration below runs on the same RULER prompts (development split: `--seed 7`; the
confirmation runs use the evals' default seed 42, never looked at while choosing), all in one
shared prefill per prompt. `--metric fidelity` (default) scores each by
`structkv.harness.eval.fidelity.measure` (KL to the full cache over the full cache's greedy
continuation, top-1 agreement, gold NLL): records in `--out/records.jsonl` (resumable), the table in
`--out/summary.md`.

    python benchmarks/structkv_dev.py --model smollm2 --chat --lengths 2048 --samples 5 \
        --tasks niah_single_1,niah_multikey_1,vt,qa_1 --kv-budget 0.1 --out research/results/structkv_dev_smollm2

`--metric ruler` generates each configuration's answer and scores it as `structkv eval ruler` does,
into an ordinary eval folder (config.json, predictions.jsonl, summary.md; each configuration's
label is its run, `configurations.json` says what each label is), so that
benchmarks/paired_ruler.py and common_subset.py read it:

    python benchmarks/structkv_dev.py --metric ruler --model smollm2 --chat --lengths 2048 --samples 5 \
        --tasks niah_single_1,niah_multikey_1,vt,qa_1 --kv-budget 0.1 \
        --out research/results/structkv_dev_ruler_smollm2_kv0.1
    python benchmarks/paired_ruler.py research/results/structkv_dev_ruler_smollm2_kv0.1 \
        --method fixed15/32+pivotskel+guideS3 --against fastkv,snapkv
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import structkv
from structkv import methods
from structkv.harness.eval import fidelity, runner
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.util.files import write_text_atomic


def configurations(kv: float, rs: float) -> dict:
    """Label -> method: the baselines, the paper's reading and the options of docs/methods.md."""
    sk = dict(kv_budget=kv, struct_budget=rs)
    return {
        "snapkv": methods.get("snapkv", kv_budget=kv),
        "pyramidkv": methods.get("pyramidkv", kv_budget=kv),
        "fastkv": methods.get("fastkv", kv_budget=kv, struct_budget=rs),
        "structkv_paper": methods.get("structkv_paper", **sk),
        "confirm2": methods.StructKV(**sk, confirm=2),
        "confirm2+eq": methods.StructKV(**sk, confirm=2, equal_compute=True),
        "confirm2+eq+guideS3": methods.StructKV(**sk, confirm=2, equal_compute=True, beta=3.0),
        "confirm2+eq+guideS1": methods.StructKV(**sk, confirm=2, equal_compute=True, beta=1.0),
        "confirm2+eq+guideC3": methods.StructKV(**sk, confirm=2, equal_compute=True, beta=3.0, guide="centrality"),
        "confirm2+eq+union+guideS3": methods.StructKV(**sk, confirm=2, equal_compute=True, beta=3.0,
                                                      skeleton="union"),
        "fixed15/32+pivotskel+guideS3": methods.StructKV(**sk, pivot=15 / 32, skeleton="pivot", beta=3.0),
        # round 2 (after reading round 1's table): which part costs the detected-pivot runs?
        "confirm2+eq+pivotskel": methods.StructKV(**sk, confirm=2, equal_compute=True, skeleton="pivot"),
        "confirm2+eq+pivotskel+guideS3": methods.StructKV(**sk, confirm=2, equal_compute=True, skeleton="pivot",
                                                          beta=3.0),
        "fixed15/32+centrality+guideS3": methods.StructKV(**sk, pivot=15 / 32, beta=3.0),
        "fixed15/32+union+guideS3": methods.StructKV(**sk, pivot=15 / 32, skeleton="union", beta=3.0),
        "fixed15/32+pivotskel+guideS1": methods.StructKV(**sk, pivot=15 / 32, skeleton="pivot", beta=1.0),
        "fixed15/32+pivotskel+guideS10": methods.StructKV(**sk, pivot=15 / 32, skeleton="pivot", beta=10.0),
        "fixed15/32+union+guideS3+decay0.5": methods.StructKV(**sk, pivot=15 / 32, skeleton="union", beta=3.0,
                                                              decay=0.5),
        # round 3: around the best of round 2
        "fixed15/32+union+guideS10+decay0.5": methods.StructKV(**sk, pivot=15 / 32, skeleton="union", beta=10.0,
                                                               decay=0.5),
        "fixed15/32+union+guideS3+decay0.3": methods.StructKV(**sk, pivot=15 / 32, skeleton="union", beta=3.0,
                                                              decay=0.3),
        "confirm2+eq+union+guideS3+decay0.5": methods.StructKV(**sk, confirm=2, equal_compute=True, skeleton="union",
                                                               beta=3.0, decay=0.5),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, default=2048)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--tasks", default="niah_single_1,niah_multikey_1,vt,qa_1")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--kv-budget", type=float, default=0.1)
    p.add_argument("--struct-budget", type=float, default=0.2)
    p.add_argument("--continuation", type=int, default=32)
    p.add_argument("--only", default=None, help="comma-separated labels to run")
    p.add_argument("--metric", choices=("fidelity", "ruler"), default="fidelity")
    p.add_argument("--eager", action="store_true", help="ruler: no torch.compile (as `structkv eval --eager`)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model = structkv.load(args.model)
    configs = configurations(args.kv_budget, args.struct_budget)
    if args.only:
        if unknown := set(args.only.split(",")) - set(configs) - {"full"}:
            p.error(f"--only: no configuration {sorted(unknown)}; valid: full, {', '.join(configs)}")
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    if args.metric == "ruler":
        return ruler_accuracy(model, configs, args, argv)
    cfg = EvalConfig(benchmark="fidelity", model=args.model, tasks=args.tasks.split(","), samples=args.samples,
                     lengths=[args.lengths], seed=args.seed, chat=args.chat, continuation=args.continuation)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {json.loads(line)["key"] for line in path.open()} if path.exists() else set()
    with path.open("a") as sink:
        for sample in build_samples(cfg, model.tokenizer):
            base = f"{args.kv_budget:g}/{sample['length_budget']}/{sample['task']}/{sample['index']}"
            todo = {k: m for k, m in configs.items() if f"{k}@{base}" not in done}
            if not todo:
                continue
            found = fidelity.measure(model, sample["input_ids"], list(todo.values()), args.continuation,
                                     fidelity.answer_ids(model.tokenizer, sample))
            for label, values in zip(todo, found):
                rec = {"key": f"{label}@{base}", "label": f"{label}@{args.kv_budget:g}", "method": label,
                       "kv_budget": args.kv_budget, "task": sample["task"], "index": sample["index"],
                       "length_budget": sample["length_budget"], **values}
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
            print(f"{sample['task']} #{sample['index']} done", file=sys.stderr, flush=True)
    records = [json.loads(line) for line in path.open()]
    result = fidelity.aggregate(records, seed=args.seed)
    table = fidelity.summary_markdown(result)
    head = (f"# StructKV development split: {args.model}, RULER {args.tasks} x {args.samples} at {args.lengths} "
            f"tokens, seed {args.seed}{', chat' if args.chat else ''}, R_KV {args.kv_budget}, R_struct "
            f"{args.struct_budget}, {args.continuation}-token continuation\n\n"
            f"Command: python benchmarks/structkv_dev.py {' '.join(argv or sys.argv[1:])}\n\n")
    write_text_atomic(out / "summary.md", head + table)
    print(head + table)
    return 0


def ruler_accuracy(model, configs: dict, args, argv) -> int:
    """RULER accuracy of every configuration (and the full cache) on the development prompts."""
    runs = {"full": methods.get("full")} if not args.only or "full" in args.only.split(",") else {}
    runs |= {f"{label}@{args.kv_budget:g}": m for label, m in configs.items()}
    cfg = EvalConfig(benchmark="ruler", model=args.model, methods=sorted({m.name for m in runs.values()}),
                     kv_budgets=[args.kv_budget], struct_budget=args.struct_budget, lengths=[args.lengths],
                     tasks=args.tasks.split(","), samples=args.samples, seed=args.seed, chat=args.chat,
                     compile=not args.eager)
    head = (f"# StructKV development split, RULER accuracy: {args.model}, {args.tasks} x {args.samples} at "
            f"{args.lengths} tokens, seed {args.seed}{', chat' if args.chat else ''}, R_KV {args.kv_budget}, "
            f"R_struct {args.struct_budget}\n\nCommand: python benchmarks/structkv_dev.py "
            f"{' '.join(argv or sys.argv[1:])}\n\n")
    run_labelled(model, cfg, runs, Path(args.out), head)
    return 0


def run_labelled(model, cfg: EvalConfig, runs: dict, out: Path, head: str) -> dict:
    """Run (or resume) labelled configurations into an eval folder: `configurations.json` says what
    each label is (labels of earlier invocations stay described), summary.md has `head` on top.
    The summary and metrics.json cover every described label's predictions on this run's samples,
    not only this run's labels (a sweep continued with `--only` keeps its earlier rows)."""
    known = out / "configurations.json"
    described = json.loads(known.read_text()) if known.exists() else {}
    described |= {label: repr(m) for label, m in runs.items()}
    result = runner.run(cfg, out, model, configs=runs, report_labels=list(described))
    write_text_atomic(known, json.dumps(described, indent=2))  # after the run: a refused folder is left as it was
    table = runner.summary_markdown(result)
    write_text_atomic(out / "summary.md", head + table)
    print(head + table)
    return result


if __name__ == "__main__":
    sys.exit(main())
