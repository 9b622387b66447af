"""Real-model check: Gemma 3 270M, needle-in-a-haystack prompts over depths, every method.

For each method at R_KV (R_struct for the propagating ones): needles found, pivot layers chosen,
prefill fraction (token-layers computed / full), KV bytes of the full-attention layers, and
whether the needle survived into the skeleton. Markdown table on stdout, rows as JSON lines.

    python research/experiments/needle_methods.py --tokens 4096 --prompts 20 [--methods full,snapkv,...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

import structkv
from structkv import methods
from structkv.harness.eval.sources import needle_prompt

DEFAULT_METHODS = "full,streaming_llm,snapkv,pyramidkv,h2o,gemfilter,fastkv,structkv"


def build(name: str, kv: float, struct: float):
    return methods.build(name, kv=kv, struct=struct)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("--struct-budget", type=float, default=0.2)
    ap.add_argument("--data", default=None)
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args()
    model = structkv.load(args.model)
    depths = [i / (args.prompts - 1) for i in range(args.prompts)] if args.prompts > 1 else [0.5]
    needles = [needle_prompt(model.tokenizer, args.tokens, d, seed=i, root=args.data) for i, d in enumerate(depths)]
    rows = []
    sink = open(args.jsonl, "w") if args.jsonl else None
    for name in args.methods.split(","):
        method = build(name, args.kv_budget, args.struct_budget)
        found, fracs, kv_bytes, pivots, secs = 0, [], [], Counter(), []
        for nd in needles:
            t = time.perf_counter()
            out = structkv.generate(model, nd.prompt_ids, max_new_tokens=12, compile=False, method=method)
            secs.append(time.perf_counter() - t)
            hit = nd.answer in out.text.replace(",", "")
            found += hit
            s = out.stats
            fracs.append(s.get("prefill_fraction", 1.0))
            if "kv_bytes_full_layers" in s:
                kv_bytes.append(s["kv_bytes_full_layers"])
            else:  # full cache: every prompt entry of every full-attention layer
                c = model.config
                per_entry = 2 * c.num_kv_heads * c.head_dim * model.dtype.itemsize
                kv_bytes.append(len(nd.prompt_ids) * per_entry * len(c.full_attention_layers))
            pivots[str(s.get("pivot_layer"))] += 1
            rec = {"method": name, "depth": nd.depth, "answer": nd.answer, "output": out.text, "found": hit,
                   "prefill_fraction": fracs[-1], "pivot": s.get("pivot_layer"), "seconds": secs[-1]}
            if sink:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
            print(json.dumps(rec), flush=True)
        rows.append((name, found, len(needles), statistics.mean(fracs), statistics.mean(kv_bytes), pivots,
                     statistics.median(secs)))
    full_bytes = None
    print(f"\nGemma 3 270M, {args.tokens}-token needle prompts, {len(needles)} depths 0..100%, "
          f"R_KV={args.kv_budget}, R_struct={args.struct_budget}, greedy, fp32 CPU\n")
    print("| method | needles found | pivot / filter layer | prefill fraction | KV bytes, full-attention layers "
          "| median s / prompt |")
    print("|---|---|---|---|---|---|")
    for name, found, n, frac, kvb, piv, sec in rows:
        if name == "full":
            full_bytes = kvb
        rel = f" ({kvb / full_bytes:.1%} of full)" if full_bytes else ""
        piv_s = ", ".join(f"{k}: {v}" for k, v in sorted(piv.items())) if "None" not in piv else "-"
        print(f"| {name} | {found}/{n} | {piv_s} | {frac:.3f} | {kvb / 2**20:.2f} MiB{rel} | {sec:.1f} |")


if __name__ == "__main__":
    main()
