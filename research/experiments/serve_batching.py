"""Load test of continuous batching in `structkv serve`: 1, 2, 4 and 8 concurrent clients, each
sending requests one after another, against the same server one request at a time
(`--max-batch 1`), in one run (side by side, alternating per client count).

Every request is a distinct prompt (a cut of the bundled LongBench documents plus a question),
compressed whole with the server's method, and streams up to --max-tokens new tokens (greedy: the
same answers, so the same work, in both modes). Prints a markdown table (research/benchmarks_log.md) and
writes the records as JSON.

    python research/experiments/serve_batching.py --model gemma-3-270m --out research/results/bench/serve_batching_gemma
    python research/experiments/serve_batching.py --model smollm2 --out research/results/bench/serve_batching_smollm2
"""
from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from serve_load import QUESTIONS, concurrently, documents, one, speeds  # noqa: E402


def run(model, args, docs, clients: int, max_batch: int) -> dict:
    import openai

    from structkv.serve import app_for
    from structkv.serve.engine import Settings
    from structkv.serve.launch import Background

    settings = Settings(model_name="m", method=args.method, kv_budget=args.kv_budget, cache_bytes=0,
                        max_queue=16, max_batch=max_batch, max_tokens=args.max_tokens, compile=False)
    with Background(app_for(model, settings)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        one(client, "m", docs[0][:200], "Warm up.", 4, args.api, context=False)
        results, lock = [], threading.Lock()

        def worker(c):
            for i in range(args.requests):
                doc = docs[(c * args.requests + i) % len(docs)]
                r = one(client, "m", doc, QUESTIONS[(c + i) % len(QUESTIONS)], args.max_tokens, args.api,
                        context=False)
                with lock:
                    results.append({"client": c, **r})

        wall = concurrently(worker, clients)
    return {"clients": clients, "max_batch": max_batch, **speeds(results, wall),
            "batch_rows_max": max(r.get("batch_rows_max", 1) for r in results), "records": results}


def table(rows: list[dict], args) -> str:
    out = [f"{args.model}, {args.method} R_KV {args.kv_budget}, prompts of {args.doc_tokens} tokens, "
           f"{args.max_tokens} new tokens each (greedy), {args.requests} requests per client, streamed, "
           f"{args.threads} threads, eager decode", "",
           "| clients | one at a time: tokens/s | batched: tokens/s | speed-up | latency p50 / p95 s (one at a time) "
           "| latency p50 / p95 s (batched) | TTFT p50 / p95 s (one at a time) | TTFT p50 / p95 s (batched) "
           "| rows per step, at most |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["clients"], r["max_batch"]): r for r in rows}
    for c in args.clients:
        a, b = by[(c, 1)], by[(c, args.max_batch)]
        out.append(f"| {c} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                   f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x | "
                   f"{a['latency_p50_s']:.1f} / {a['latency_p95_s']:.1f} "
                   f"| {b['latency_p50_s']:.1f} / {b['latency_p95_s']:.1f} | {a['ttft_p50_s']:.1f} / "
                   f"{a['ttft_p95_s']:.1f} | {b['ttft_p50_s']:.1f} / {b['ttft_p95_s']:.1f} | {b['batch_rows_max']} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--method", default="structkv")
    p.add_argument("--kv-budget", type=float, default=0.1)
    p.add_argument("--clients", default="1,2,4,8", help="comma-separated concurrent client counts")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--api", default=None, choices=["chat", "completions"])
    p.add_argument("--out", default=None, help="write the table (.md) and records (.json) here")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    import torch

    import structkv

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    args.api = args.api or ("chat" if model.tokenizer.chat_template else "completions")
    docs = documents(model.tokenizer, max(args.clients) * args.requests, args.doc_tokens, every=True)
    rows = []
    for c in args.clients:
        for max_batch in (1, args.max_batch):
            rows.append(run(model, args, docs, c, max_batch))
            print(f"clients {c}, max_batch {max_batch}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    text = table(rows, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_batching.md").write_text(text + "\n")
        (out / "serve_batching.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
