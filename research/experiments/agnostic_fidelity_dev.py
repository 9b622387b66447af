"""Query-agnostic StructKV signals compared by fidelity on a development split (question after
compression): RULER needles and LongBench prose, code and few-shot prompts in one run.

A task score flips on one token and the development splits are small; the fidelity KL (the full
cache's continuation teacher-forced through each compressed context + the uncompressed question,
`structkv.harness.eval.fidelity.measure`) moves smoothly, so it can choose between signals that
answer-accuracy on 16-18 prompts cannot separate. Records go to `records.jsonl` (one line per
prompt and label, resumable; `config.json` holds the settings, and a folder made with others is
refused); `summary.md` has the mean KL per benchmark kind and label, and the
worse of the two kinds relative to the best label on each (the criterion: a default must not
collapse on either kind of document).

    python research/experiments/agnostic_fidelity_dev.py --kv-budget 0.1 --out /tmp/agnostic_fidelity_dev
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import structkv
from structkv import methods
from structkv.harness.eval.fidelity import answer_ids, measure
from structkv.harness.eval.result_folder import open_output, read_predictions
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.util.files import write_text_atomic

RULER = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery,qa_1,vt,cwe,fwe"
LONGBENCH = "narrativeqa,qasper,hotpotqa,2wikimqa,gov_report,lcc,repobench-p,triviaqa,trec,samsum"
CANDIDATES = {
    "window": dict(),
    "novelty": dict(signal="novelty"),
    "union": dict(signal="union"),
    "union25": dict(signal="union", window_share=0.25),
    "union75": dict(signal="union", window_share=0.75),
    "novelty+k15": dict(signal="novelty", kernel=15),
    "novelty+w128": dict(signal="novelty", window=128),
    "union+w32": dict(signal="union", window=32),
    "union+w32/kv-novelty": dict(signal="union", window=32, kv_signal="novelty"),
    "union+w32/kv-novelty-guide0": dict(signal="union", window=32, kv_signal="novelty", beta=0.0),
    "novelty+w32/kv-union": dict(signal="novelty", window=32, kv_signal="union"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--lengths", type=int, default=4096)
    p.add_argument("--tasks", default=f"{RULER},{LONGBENCH}")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--first", type=int, default=2, help="first sample of every task (2: never a confirmation prompt)")
    p.add_argument("--kv-budget", type=float, default=0.1)
    p.add_argument("--struct-budget", type=float, default=0.2)
    p.add_argument("--continuation", type=int, default=32)
    p.add_argument("--only", help=f"comma-separated labels of {', '.join(CANDIDATES)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    labels = args.only.split(",") if args.only else list(CANDIDATES)
    if unknown := set(labels) - set(CANDIDATES):
        p.error(f"--only: no candidate {sorted(unknown)}; valid: {', '.join(CANDIDATES)}")
    out = Path(args.out)
    cfg = EvalConfig(benchmark="fidelity", model=args.model, kv_budgets=[args.kv_budget],
                     struct_budget=args.struct_budget, lengths=[args.lengths], tasks=args.tasks.split(","),
                     samples=args.samples, seed=args.seed, first=args.first, question_after=True,
                     continuation=args.continuation, compile=False)
    known = out / "config.json"  # the records' keys carry no budget: one folder, one R_KV
    if known.exists() and json.loads(known.read_text())["config"]["kv_budgets"] != cfg.kv_budgets:
        p.error(f"{out} holds records at another R_KV; choose another --out folder")
    try:
        done = open_output(cfg, out, name="records.jsonl")  # refuses other settings, repairs a cut last line
    except ValueError as e:
        p.error(str(e))
    sink = out / "records.jsonl"
    model = structkv.load(args.model)
    for sample in build_samples(cfg, model.tokenizer):
        todo = [label for label in labels if f"{label}|{sample['task']}|{sample['index']}" not in done]
        if not todo:
            continue
        runs = [methods.get("structkv", kv_budget=args.kv_budget, struct_budget=args.struct_budget, **CANDIDATES[label])
                for label in todo]
        found = measure(model, sample["input_ids"], runs, args.continuation, answer_ids(model.tokenizer, sample),
                        question=sample.get("question_ids"))
        with sink.open("a") as f:
            for label, values in zip(todo, found):
                f.write(json.dumps({"key": f"{label}|{sample['task']}|{sample['index']}", "label": label,
                                    "task": sample["task"], "index": sample["index"], **values}) + "\n")
        print(sample["task"], sample["index"], {label: round(v["kl"], 3) for label, v in zip(todo, found)}, flush=True)
    write_text_atomic(out / "summary.md", summary(sink, args, argv))
    print((out / "summary.md").read_text())
    return 0


def summary(sink: Path, args, argv) -> str:
    """Per kind (RULER / LongBench) and label: mean KL and mean gold-answer NLL above the full
    cache's (the answer's own tokens: what decides a score), and the worse of the two kinds'
    KL relative to the best label there."""
    ruler = set(RULER.split(","))
    kl: dict[tuple[str, str], list[float]] = {}
    gold: dict[tuple[str, str], list[float]] = {}
    for r in read_predictions(sink, quiet=True).values():
        key = ("ruler" if r["task"] in ruler else "longbench", r["label"])
        kl.setdefault(key, []).append(r["kl"])
        gold.setdefault(key, []).append(r["gold_nll"] - r["full_gold_nll"])
    mean = {k: sum(v) / len(v) for k, v in kl.items()}
    labels = sorted({label for _, label in mean})
    best = {kind: min(m for (k, _), m in mean.items() if k == kind) for kind in ("ruler", "longbench")}
    lines = [f"# Fidelity KL (question after compression), development split: seed {args.seed}, samples from "
             f"{args.first}, R_KV {args.kv_budget}, R_struct {args.struct_budget}",
             "", f"Command: python research/experiments/agnostic_fidelity_dev.py {' '.join(argv or sys.argv[1:])}", "",
             "| label | RULER KL | RULER gold NLL - full | LongBench KL | LongBench gold NLL - full | prompts "
             "| worse KL / best |", "|---|---|---|---|---|---|---|"]
    for label in labels:
        cells, worst, count = [], 0.0, 0
        for kind in ("ruler", "longbench"):
            if (kind, label) not in mean:
                cells += ["-", "-"]
                continue
            values = gold[kind, label]
            cells += [f"{mean[kind, label]:.3f}", f"{sum(values) / len(values):+.3f}"]
            worst, count = max(worst, mean[kind, label] / max(best[kind], 1e-9)), count + len(values)
        lines.append(f"| {label} | {' | '.join(cells)} | {count} | {worst:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
