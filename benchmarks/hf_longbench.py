"""LongBench through `structkv.hf`: any transformers causal LM (a GPU user's Llama-3.1-8B-Instruct),
structkv's method selection, structkv's LongBench data and metrics.

    python benchmarks/hf_longbench.py --model meta-llama/Llama-3.1-8B-Instruct --device cuda \\
        --methods full,snapkv,pyramidkv --kv-budget 0.1 --length 32768 --samples 200 --out results/hf_longbench.jsonl

The paper's setting (arXiv 2604.06746: LongBench, R_KV 10 %) is this command with its 16 English
tasks (the default `--tasks`). Post-prefill methods only (structkv.hf refuses StructKV / FastKV /
GemFilter, whose token pruning runs in structkv's own decoder: `structkv eval longbench`).
Prompts are LongBench's own templates, middle-truncated to `--length` tokens, the question inside
the compressed text (`--question-after` puts it after). One line per (task, record, method) in
`--out`, appended as each finishes (a rerun resumes); a table of means per task on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


class _Encoder:
    """The `encode(text, add_bos=)` the LongBench loader speaks, over a transformers tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_bos)["input_ids"]


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import structkv.hf
    from structkv import methods
    from structkv.harness.eval import longbench
    from structkv.harness.eval.metrics import longbench_score

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers model id or folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--methods", default="full,snapkv")
    p.add_argument("--kv-budget", type=float, default=0.1)
    p.add_argument("--tasks", default=",".join(longbench.TASKS))
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (middle-truncated)")
    p.add_argument("--samples", type=int, default=None, help="records per task (default: all)")
    p.add_argument("--question-after", action="store_true", help="compress the context only; ask after it")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    done = set()
    if args.out.exists():
        done = {(d["task"], d["index"], d["method"]) for d in map(json.loads, args.out.read_text().splitlines())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scores: dict = {}
    for task in args.tasks.split(","):
        records = longbench.load(task, _Encoder(tokenizer), args.length, samples=args.samples,
                                 split_question=args.question_after)
        for rec in records:
            for name in args.methods.split(","):
                if (task, rec["index"], name) in done:
                    continue
                method = methods.get(name) if name == "full" else methods.get(name, kv_budget=args.kv_budget)
                new = rec["max_new_tokens"]
                if args.question_after:
                    state = structkv.hf.compress(model, tokenizer, rec["input_ids"], method)
                    out = structkv.hf.generate(model, tokenizer, rec["question_ids"], state=state, max_new_tokens=new)
                else:
                    out = structkv.hf.generate(model, tokenizer, rec["input_ids"], method=method, max_new_tokens=new)
                s = longbench_score(task, out["text"], rec["outputs"], rec["all_classes"])
                scores.setdefault((task, name), []).append(s)
                with args.out.open("a") as f:  # a whole line per prediction: a crash loses the one in flight
                    f.write(json.dumps({"task": task, "index": rec["index"], "method": name, "score": s,
                                        "prediction": out["text"]}) + "\n")
    for (task, name), values in sorted(scores.items()):
        print(f"{task:22s} {name:14s} {100 * statistics.fmean(values):6.2f}  ({len(values)} records)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
