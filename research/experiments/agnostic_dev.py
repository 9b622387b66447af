"""Query-agnostic configurations, RULER or LongBench accuracy with the question after compression.

Development split: RULER `--seed 7`, LongBench `--first 2` (records 2.. of each task file): choose
here; confirmation split: seed 42 and records 0.. (the evals' defaults, run once the choice is
made, never used to choose). Every configuration answers the same prompts,
all in one shared prefill per prompt (the probe's configurations in one more pass), into an
ordinary eval folder (config.json, predictions.jsonl, summary.md; `configurations.json` says what
each label is), which benchmarks/paired_ruler.py and common_subset.py read.

    python research/experiments/agnostic_dev.py --seed 7 --samples 2 --kv-budget 0.2 \
        --out research/results/agnostic_dev_ruler_4k_kv0.2
    python research/experiments/agnostic_dev.py --benchmark longbench --first 2 --samples 1 --max-new-tokens 64 \
        --kv-budget 0.1,0.2 --out research/results/agnostic_dev_longbench_4k
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from structkv_dev import run_labelled  # noqa: E402

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig

# Query-free probes tried on the development split (the text after the context while compressing).
PROBES = {
    "say": "\n\nWhat does the text above say?",
    "facts": "\n\nQuestion: Which facts, names and numbers does the text above contain?\nAnswer:",
}
TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery,qa_1,vt,niah_many"
# Recency and the window's own look back, tried beside novelty (LongBench's prose and code lose
# with novelty alone): a wider always-kept window, and the "mixed" signal.
RECENCY = {"novelty+w32": dict(signal="novelty", window=32), "novelty+w128": dict(signal="novelty", window=128),
           "mixed": dict(signal="mixed"), "mixed+w32": dict(signal="mixed", window=32),
           "mixed+w128": dict(signal="mixed", window=128), "union": dict(signal="union"),
           "union+w32": dict(signal="union", window=32),
           "union25+w32": dict(signal="union", window_share=0.25, window=32),
           "union10+w32": dict(signal="union", window_share=0.1, window=32),
           "union02+w32": dict(signal="union", window_share=0.02, window=32),
           "union02+w32-guide0": dict(signal="union", window_share=0.02, window=32, beta=0.0),
           "union+w32/kv-novelty": dict(signal="union", window=32, kv_signal="novelty"),
           "union+w32/kv-novelty-guide0": dict(signal="union", window=32, kv_signal="novelty", beta=0.0),
           "novelty+w32/kv-union": dict(signal="novelty", window=32, kv_signal="union")}


def configurations(kv: float, rs: float) -> dict:
    """Label -> method: the query-agnostic baselines, the window methods with probes, and StructKV
    with a query-free signal (key novelty) or a probe; `structkv` and `structkv_paper` as they are."""
    b = dict(kv_budget=kv)
    s = dict(kv_budget=kv, struct_budget=rs)
    out = {
        "snapkv": methods.get("snapkv", **b), "kvzip": methods.get("kvzip", **b),
        "keydiff": methods.get("keydiff", **b), "keydiff+pool7": methods.get("keydiff", kernel=7, **b),
        "expected_attention": methods.get("expected_attention", **b),
        "structkv": methods.get("structkv", **s), "structkv_paper": methods.get("structkv_paper", **s),
        "structkv+novelty": methods.get("structkv", signal="novelty", **s),
        "structkv+novelty-guide0": methods.get("structkv", signal="novelty", beta=0.0, **s),
    }
    for name, options in RECENCY.items():
        out[f"structkv+{name}"] = methods.get("structkv", **options, **s)
    for name, text in PROBES.items():
        out[f"snapkv+probe:{name}"] = methods.get("snapkv", probe=text, **b)
        out[f"structkv+probe:{name}"] = methods.get("structkv", probe=text, **s)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--lengths", type=int, default=4096)
    p.add_argument("--benchmark", choices=("ruler", "longbench"), default="ruler")
    p.add_argument("--tasks", help=f"comma-separated (default: RULER {TASKS}; LongBench every task)")
    p.add_argument("--first", type=int, default=0, help="first sample index of every task (LongBench's dev split: 2)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--kv-budget", default="0.2", help="comma-separated R_KV ratios (one shared prefill for all)")
    p.add_argument("--question-inside", action="store_true",
                   help="compress the whole prompt, question included (the other setting, for the same configurations)")
    p.add_argument("--struct-budget", type=float, default=0.2)
    p.add_argument("--only", help="comma-separated labels (full is always run)")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    budgets = [float(b) for b in args.kv_budget.split(",")]
    runs = {"full": methods.get("full")}
    for budget in budgets:
        configs = configurations(budget, args.struct_budget)
        if args.only:
            wanted = args.only.split(",")
            if unknown := set(wanted) - set(configs):
                p.error(f"--only: no configuration {sorted(unknown)}; valid: {', '.join(configs)}")
            configs = {k: v for k, v in configs.items() if k in wanted}
        runs |= {f"{label}@{budget:g}": m for label, m in configs.items()}
    tasks = args.tasks or (TASKS if args.benchmark == "ruler" else None)
    cfg = EvalConfig(benchmark=args.benchmark, model=args.model, methods=sorted({m.name for m in runs.values()}),
                     kv_budgets=budgets, struct_budget=args.struct_budget, lengths=[args.lengths],
                     tasks=tasks.split(",") if tasks else None, samples=args.samples, seed=args.seed,
                     first=args.first, max_new_tokens=args.max_new_tokens, chat=args.chat,
                     question_after=not args.question_inside, compile=False)
    setting = "question inside the compressed prompt" if args.question_inside else "question after compression"
    head = (f"# Query-agnostic configurations ({setting}): {args.model}, {args.benchmark} {tasks or 'every task'} x "
            f"{args.samples} from sample {args.first} at {args.lengths} tokens, seed {args.seed}, "
            f"R_KV {args.kv_budget}, R_struct "
            f"{args.struct_budget}\n\nCommand: python research/experiments/agnostic_dev.py {' '.join(argv or sys.argv[1:])}\n\n")
    run_labelled(model, cfg, runs, Path(args.out), head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
