"""Compiled generation, one method per process: graphs, compile time, prefill, decode, host syncs.

Runs the same measurement against any checkout of structkv (PYTHONPATH picks it), so a change to
the loop can be compared with the commit before it in one table:

    PYTHONPATH=/path/to/old/checkout python research/experiments/compile_before_after.py \
        --model gemma-3-270m --length 4096 --method structkv --label before >> rows.jsonl
    python research/experiments/compile_before_after.py --model gemma-3-270m --length 4096 --method structkv \
        --label after >> rows.jsonl
    python research/experiments/compile_before_after.py --table rows.jsonl

Each run starts from an empty inductor cache (a temporary folder), so `first_call_s` includes the
whole compile; `graphs` is dynamo's count of distinct graphs compiled by the first call; the
steady prefill and decode are medians of `--repeats` calls after it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def measure(args) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    import torch
    import torch._dynamo.utils

    import structkv
    from structkv import methods

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    if model.tokenizer is not None:
        text = "The quick brown fox jumps over the lazy dog. " * (args.length // 4)
        ids = model.tokenizer.encode(text)[:args.length]
    else:
        ids = torch.randint(0, model.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
        ids = ids.tolist()
    method = None if args.method == "full" else methods.get(args.method, kv_budget=args.kv_budget)

    def call():
        return structkv.generate(model, ids, max_new_tokens=args.new_tokens, method=method, stop_at_eos=False,
                                 compile=True)

    t = time.perf_counter()
    first = call()
    first_s = time.perf_counter() - t
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runs = [call().stats for _ in range(args.repeats)]
    return {"label": args.label, "model": args.model, "tokens": len(ids), "method": args.method,
            "graphs": graphs, "first_call_s": first_s,
            "prefill_s": statistics.median(r["prefill_s"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "host_syncs": first.stats.get("host_syncs"), "threads": args.threads}


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    out = ["| model | tokens | method | run | graphs | first call s (compile) | prefill s | decode tok/s | syncs |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["tokens"], r["method"], r["label"] != "before")):
        out.append(f"| {r['model']} | {r['tokens']} | {r['method']} | {r['label']} | {r['graphs']} | "
                   f"{r['first_call_s']:.1f} | {r['prefill_s']:.2f} | {r['decode_tokens_per_s']:.1f} | "
                   f"{r['host_syncs'] if r['host_syncs'] is not None else '-'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--method", default="structkv")
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="after")
    ap.add_argument("--table", help="print the markdown table of a rows.jsonl file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
