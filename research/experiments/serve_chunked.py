"""Chunked prefill in `structkv serve`: the running streams' time between tokens while a long
prompt arrives, with the prefill sliced between their decode steps (`--prefill-rows`, the
default) and run alone (`--prefill-rows 0`), side by side in one run (alternating per round).

Each round starts a server, lets --streams clients decode (short prompts, greedy, streamed) for
--idle-s seconds, then sends one long document (--prompt-tokens, in the `context` field: a context
cache miss, compressed with the server's context default) with a question. Inter-token gaps of
the running streams are split into the idle window (before the long request is sent) and the
arrival window (from its sending to its first token); the table gives their p50 / p95, the p95
ratio (arrival / idle; the issue's target is < 2) and the long request's time to first token.

    python research/experiments/serve_chunked.py --model gemma-3-270m --shares 0.4,1.0 \
        --out research/results/bench/serve_chunked_gemma
    python research/experiments/serve_chunked.py --model gemma-3-270m --rounds 0 --slicing-cost --out ...  # slicing's own cost
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from serve_load import documents, pct  # noqa: E402

STREAM_PROMPT = "Chapter 1. The lighthouse keeper climbed the stairs at dusk, as she had every night for thirty years."


def stream(client, max_tokens, marks, stop):
    """One streamed request; appends each text delta's arrival time to `marks` until `stop` is set."""
    parts = client.completions.create(model="m", prompt=STREAM_PROMPT, max_tokens=max_tokens, temperature=0,
                                      stream=True)
    for part in parts:
        if part.choices and part.choices[0].text:
            marks.append(time.perf_counter())
        if stop.is_set():
            parts.response.close()
            return


def gaps(marks, lo, hi):
    """Inter-token gaps (seconds) of one stream that end inside [lo, hi)."""
    return [b - a for a, b in zip(marks, marks[1:]) if lo <= b < hi]


def one_round(model, args, doc, rows: int, share: float) -> dict:
    import openai

    from structkv.serve import app_for
    from structkv.serve.engine import Settings
    from structkv.serve.launch import Background

    settings = Settings(model_name="m", cache_bytes=args.cache_bytes, max_batch=args.streams + 1,
                        max_tokens=args.stream_tokens, compile=False, prefill_rows=rows,
                        prefill_share=share)
    with Background(app_for(model, settings)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=900, max_retries=0)
        client.completions.create(model="m", prompt="Hi.", max_tokens=2)
        stop, marks = threading.Event(), [[] for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(client, args.stream_tokens, m, stop))
                   for m in marks]
        for t in threads:
            t.start()
        while min(len(m) for m in marks) < 3:  # every stream is decoding
            time.sleep(0.01)
        t_idle = time.perf_counter()
        time.sleep(args.idle_s)
        t_send = time.perf_counter()
        parts = client.completions.create(model="m", prompt="\n\nQuestion: What is this text about?\nAnswer:",
                                          max_tokens=8, temperature=0, stream=True, extra_body={"context": doc})
        t_first, stats = None, {}
        for part in parts:
            if t_first is None and part.choices and part.choices[0].text:
                t_first = time.perf_counter()
            stats = (part.model_extra or {}).get("structkv", stats)
        t_first = t_first or time.perf_counter()
        stop.set()
        for t in threads:
            t.join(60)
    idle = [g for m in marks for g in gaps(m, t_idle, t_send)]
    arrival = [g for m in marks for g in gaps(m, t_send, t_first)]
    if not idle or not arrival:
        raise RuntimeError("the streams ended before the measurement windows closed: raise --stream-tokens")
    return {"prefill_rows": rows, "prefill_share": share if rows else None,
            "idle_p50_s": statistics.median(idle), "idle_p95_s": pct(idle, 0.95),
            "arrival_p50_s": statistics.median(arrival), "arrival_p95_s": pct(arrival, 0.95),
            "arrival_max_s": max(arrival), "p95_ratio": pct(arrival, 0.95) / pct(idle, 0.95),
            "ttft_s": t_first - t_send, "prefill_s": stats.get("prefill_s"), "gaps_idle": len(idle),
            "gaps_arrival": len(arrival), "method": stats.get("method")}


def slicing_cost(model, doc: str, rows: int, repeats: int = 2) -> dict:
    """The context's prefill alone (nothing decoding), whole and sliced, alternated: what slicing
    itself costs, apart from the streams' share."""
    import torch

    from structkv import methods
    from structkv.models.sliced import sliced_block
    from structkv.runtime.compress import prefill

    name, kv = methods.context_default(model.config)
    method = methods.build(name, kv=kv)
    ids = model.tokenizer.encode(doc)
    times = {"whole": [], "sliced": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for mode in ("whole", "sliced"):
                t0 = time.perf_counter()
                prefill(model, ids, method, room=64, archive=methods.context_archive(method),
                        block=sliced_block(lambda: None, rows) if mode == "sliced" else None)
                times[mode].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def table(rows: list[dict], args) -> str:
    lines = [f"{args.model}, {args.streams} running streams, a {args.prompt_tokens}-token context arriving "
             f"(threads {args.threads}, {args.rounds} round(s) per mode; medians over rounds):", "",
             "| prefill | ITL idle p50 / p95 ms | ITL while it arrives p50 / p95 / max ms | p95 ratio | "
             "its TTFT s | gaps idle / arriving |", "|---|---|---|---|---|---|"]
    for mode in sorted({(r["prefill_rows"], r["prefill_share"] or 0) for r in rows}, reverse=True):
        rs = [r for r in rows if (r["prefill_rows"], r["prefill_share"] or 0) == mode]

        def med(k):
            return statistics.median(r[k] for r in rs)

        name = f"sliced ({mode[0]} rows, share {mode[1]:g})" if mode[0] else "alone (0)"
        lines.append(f"| {name} | {1e3 * med('idle_p50_s'):.0f} / {1e3 * med('idle_p95_s'):.0f} | "
                     f"{1e3 * med('arrival_p50_s'):.0f} / {1e3 * med('arrival_p95_s'):.0f} / "
                     f"{1e3 * med('arrival_max_s'):.0f} | {med('p95_ratio'):.2f} | {med('ttft_s'):.1f} | "
                     f"{sum(r['gaps_idle'] for r in rs)} / {sum(r['gaps_arrival'] for r in rs)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=4096, help="new tokens per stream, at most")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--idle-s", type=float, default=4.0)
    p.add_argument("--rows", type=int, default=None, help="the sliced mode's --prefill-rows (default: serve's)")
    p.add_argument("--shares", default=None, help="the sliced mode's --prefill-share values, comma-separated "
                                                   "(default: serve's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cache-bytes", type=int, default=1 << 30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slicing-cost", action="store_true",
                   help="also time the context's prefill alone, whole and sliced (alternated, 2 each)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    import structkv
    from structkv.serve.engine import Settings

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    sliced = args.rows if args.rows is not None else Settings.prefill_rows
    shares = [float(x) for x in args.shares.split(",")] if args.shares else [Settings.prefill_share]
    modes = [(sliced, share) for share in shares] + [(0, 0.0)]
    docs = documents(model.tokenizer, args.rounds * len(modes), args.prompt_tokens, every=True) if args.rounds else []
    rows = []
    for r in range(args.rounds):
        for mode in modes:  # a fresh document each time: always a cache miss
            rows.append(one_round(model, args, docs[len(rows)], *mode))
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows, args) if rows else ""
    if args.slicing_cost:
        cost = slicing_cost(model, docs[0] if docs else documents(model.tokenizer, 1, args.prompt_tokens)[0], sliced)
        text += (f"\n\nThe {args.prompt_tokens}-token context's prefill alone (nothing decoding, medians of 2, "
                 f"alternated): whole {cost['whole']:.2f} s, sliced ({sliced} rows) {cost['sliced']:.2f} s "
                 f"({cost['sliced'] / cost['whole']:.2f}x)")
        rows.append({"slicing_cost": cost})
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "records.json" if args.rounds else "slicing_cost.json"
        (out / name).write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))
        (out / ("table.md" if args.rounds else "slicing_cost.md")).write_text(text.strip() + "\n")


if __name__ == "__main__":
    main()
