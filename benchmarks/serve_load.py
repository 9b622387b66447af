"""Load test of `structkv serve` over loopback: N concurrent clients ask M questions each about K long
documents, with the compressed-context cache on and off, in one run (side by side).

Each request sends the document as the `context` field and one question as the user turn, and
streams the answer (the client measures time to first token). With the cache on, a document is
compressed once and every later question about it only prefills itself; off (--cache-bytes 0),
every request compresses its document again. Documents: the bundled LongBench subset (qasper,
narrativeqa, ...) cut to --doc-tokens. Prints a markdown table (research/benchmarks_log.md) and writes JSON.

    python benchmarks/serve_load.py --model gemma-3-270m --clients 2 --questions 3 --docs 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

QUESTIONS = ["What is this text about?", "Who or what is mentioned first?", "Summarise it in one sentence.",
             "What is the last point it makes?", "Name one number it gives."]
TASKS = ["qasper", "narrativeqa", "gov_report", "multifieldqa_en", "hotpotqa"]


def documents(tokenizer, k: int, tokens: int, every: bool = False) -> list[str]:
    """k documents of `tokens` tokens: the first long enough of each task (`every`: all of them)."""
    from structkv.harness.eval.longbench import task_file

    docs = []
    for task in TASKS:
        for line in task_file(task).read_text().splitlines():
            ids = tokenizer.encode(json.loads(line)["context"], add_bos=False)
            if len(ids) >= tokens:
                docs.append(tokenizer.decode(ids[:tokens]))
                if not every or len(docs) == k:
                    break
        if len(docs) == k:
            return docs
    raise ValueError(f"the bundled LongBench subset has fewer than {k} documents of {tokens} tokens")


def one(client, model, doc, question, max_tokens, api, context: bool = True) -> dict:
    """One streamed request; the document goes in the `context` field (chat: before the question in
    the user turn; completions: before the prompt), or with `context=False` into the prompt itself
    (compressed whole, question included)."""
    t0 = time.perf_counter()
    first, stats, n = None, None, 0
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"context": doc} if context else None)
    head = "" if context else doc
    if api == "chat":
        parts = client.chat.completions.create(
            messages=[{"role": "user", "content": f"{head}\n\n{question}" if head else question}], **common)
    else:
        parts = client.completions.create(prompt=f"{head}\n\nQuestion: {question}\nAnswer:", **common)
    for part in parts:
        new = part.choices and (part.choices[0].delta.content if api == "chat" else part.choices[0].text)
        if new and first is None:
            first = time.perf_counter() - t0
        extra = part.model_extra or {}
        stats = extra.get("structkv", stats)
        if part.usage is not None:
            n = part.usage.completion_tokens
    total = time.perf_counter() - t0
    return {"latency_s": total, "ttft_s": first if first is not None else total, "tokens": n, **(stats or {})}


def run_mode(model, args, docs, cache_bytes: int) -> dict:
    import httpx
    import openai

    from structkv.serve import app_for
    from structkv.serve.engine import Settings
    from structkv.serve.launch import Background

    settings = Settings(model_name="m", method=args.method, kv_budget=args.kv_budget, cache_bytes=cache_bytes,
                        max_queue=args.clients * 2, max_tokens=args.max_tokens, compile=args.compile)
    with Background(app_for(model, settings)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        one(client, "m", docs[0][: len(docs[0]) // 2], "Warm up.", args.max_tokens, args.api)  # compiles; untimed
        results, lock = [], threading.Lock()

        def worker(c):
            for i in range(args.questions):
                for d, doc in enumerate(docs):
                    q = QUESTIONS[(c + i) % len(QUESTIONS)]
                    r = one(client, "m", doc, q, args.max_tokens, args.api)
                    with lock:
                        results.append({"client": c, "doc": d, **r})

        wall = concurrently(worker, args.clients)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    held = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("structkv_context_cache_bytes "))
    return summarise(results, wall, held, cache_bytes)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def concurrently(worker, clients: int) -> float:
    """`worker(c)` for every client c at once, each on its own thread; the wall seconds until all end."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def speeds(results: list[dict], wall: float) -> dict:
    """What every load test reports of its streamed requests (`one`'s records): count, new tokens,
    aggregate tokens/s, latency and time-to-first-token p50 / p95."""
    lat, ttft = [r["latency_s"] for r in results], [r["ttft_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": statistics.median(lat), "latency_p95_s": pct(lat, 0.95),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95)}


def summarise(results, wall, held, cache_bytes) -> dict:
    hits = sum(r.get("context_cache") == "hit" for r in results)
    by = {k: [r["prefill_s"] for r in results if r.get("context_cache") == k] for k in ("hit", "miss")}
    return {"cache_bytes_limit": cache_bytes, **speeds(results, wall), "requests_per_s": len(results) / wall,
            "cache_hits": hits,
            "prefill_hit_p50_s": statistics.median(by["hit"]) if by["hit"] else float("nan"),
            "prefill_miss_p50_s": statistics.median(by["miss"]) if by["miss"] else float("nan"),
            "cache_held_mib": held / 2**20, "kv_mib_kept_mean": statistics.mean(r["kv_bytes_kept"] for r in results)
            / 2**20, "records": results}


def table(on: dict, off: dict, args) -> str:
    rows = [("requests", "{requests}"), ("wall s", "{wall_s:.1f}"), ("requests / s", "{requests_per_s:.3f}"),
            ("new tokens / s", "{tokens_per_s:.2f}"),
            ("latency p50 / p95 s", "{latency_p50_s:.2f} / {latency_p95_s:.2f}"),
            ("TTFT p50 / p95 s (client side, queue included)", "{ttft_p50_s:.2f} / {ttft_p95_s:.2f}"),
            ("context cache hits", "{cache_hits}"),
            ("server prefill p50 s: hits / misses", "{prefill_hit_p50_s:.2f} / {prefill_miss_p50_s:.2f}"),
            ("cache memory held MiB", "{cache_held_mib:.1f}"), ("KV MiB kept per request", "{kv_mib_kept_mean:.2f}")]
    out = [f"{args.clients} clients x {args.questions} questions x {args.docs} documents of {args.doc_tokens} tokens, "
           f"{args.model}, {args.method} R_KV {args.kv_budget}, {args.max_tokens} new tokens max, streamed from "
           f"/v1/{'chat/' if args.api == 'chat' else ''}completions",
           "", "| | cache on | cache off (--cache-bytes 0) |", "|---|---|---|"]
    out += [f"| {name} | {fmt.format(**on)} | {fmt.format(**off)} |" for name, fmt in rows]
    out += ["", f"TTFT p50 without / with the cache: {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x; prefill of a hit vs "
            f"a miss (server side, p50): {on['prefill_miss_p50_s'] / on['prefill_hit_p50_s']:.1f}x shorter; "
            f"throughput with / without: {on['requests_per_s'] / off['requests_per_s']:.2f}x"]
    return "\n".join(out)


def rerender(folder) -> str:
    """The table again from a run's serve_load.json (after changes to the table only)."""
    d = json.loads((Path(folder) / "serve_load.json").read_text())
    args = argparse.Namespace(**d["args"])
    on, off = (summarise(d[m]["records"], d[m]["wall_s"], d[m]["cache_held_mib"] * 2**20, d[m]["cache_bytes_limit"])
               for m in ("cache_on", "cache_off"))
    return table(on, off, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--method", default="structkv")
    p.add_argument("--kv-budget", type=float, default=0.1)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--compile", default="auto", choices=["auto", "never"])
    p.add_argument("--api", default=None, choices=["chat", "completions"],
                   help="default: chat when the model has a chat template (SmolLM2), else completions (Gemma 3 270M "
                        "base)")
    p.add_argument("--out", default=None, help="write the table (.md) and records (.json) here")
    args = p.parse_args()
    args.compile = "auto" if args.compile == "auto" else False
    import structkv

    model = structkv.load(args.model)
    args.api = args.api or ("chat" if model.tokenizer.chat_template else "completions")
    docs = documents(model.tokenizer, args.docs, args.doc_tokens)
    on = run_mode(model, args, docs, 1 << 30)
    off = run_mode(model, args, docs, 0)
    text = table(on, off, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_load.md").write_text(text + "\n")
        (out / "serve_load.json").write_text(json.dumps({"args": vars(args), "cache_on": on, "cache_off": off},
                                                        indent=1))


if __name__ == "__main__":
    main()
