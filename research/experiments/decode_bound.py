"""Fidelity of a KV bound over a long continuation: how far `max_kv_tokens` moves the model.

Per LongBench record (a summary task: long outputs), the full cache generates `--continuation`
tokens greedily (EOS does not stop it); the same tokens are teacher-forced, step by step in
lockstep, through one bounded cache per (bound, rule). Per step: KL(full || bounded) of the next-
token distributions and whether the bounded cache's argmax is the full cache's token. Per row: the
means over the continuation, and over its second half (where a bound has evicted most), the peak
entries per layer, evictions, seconds spent evicting, decode tokens/s of that row's own steps and
its KV bytes allocated at the end. Rows of one record share one run, so their speeds compare.

    python research/experiments/decode_bound.py --model gemma-3-270m --tasks gov_report --first 0 \\
        --context 1024 --continuation 1024 --bounds 256,512,1024 --rules window,redundancy,recent \\
        --out research/results/decode_bound/dev_gemma.jsonl

Resumes: records already in `--out` are skipped; `summary.md` beside it is rewritten.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import structkv
from structkv.harness.eval import longbench
from structkv.modules import DecodeBound
from structkv.runtime.decoding import Decoding, bounded
from structkv.runtime.generation import start
from structkv.util.files import write_text_atomic


@torch.inference_mode()
def measure(model, ids: list[int], continuation: int, bounds: list[DecodeBound]) -> list[dict]:
    """One row for the full cache and one per bound: KL and top-1 agreement per step, means."""
    runs = [None, *bounds]
    rows = []
    for bound in runs:
        run = start(model, ids, max_new_tokens=continuation, bound=bound)
        rows.append(Decoding(model, run.cache, run.logits, run.next_pos, bound=bounded(model, run.cache, bound)))
    kl = [[] for _ in bounds]
    agree = [[] for _ in bounds]
    seconds = [0.0] * len(runs)
    for step in range(continuation):
        ref = rows[0].logits.float().log_softmax(-1)  # (1, V)
        token = ref.argmax(-1)
        for i, row in enumerate(rows[1:]):
            logp = row.logits.float().log_softmax(-1)
            kl[i].append(float((ref.exp() * (ref - logp)).sum()))
            agree[i].append(float(logp.argmax(-1) == token))
        if step == continuation - 1:
            break
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            row.feed(token)
            seconds[i] += time.perf_counter() - t0
    half = continuation // 2
    out = [{"bound": None, "rule": "full", "tokens_per_s": (continuation - 1) / seconds[0],
            "kv_bytes_allocated": sum(layer.nbytes() for layer in rows[0].cache.layers)}]
    for i, (bound, row) in enumerate(zip(bounds, rows[1:])):
        out.append({"bound": bound.max_tokens, "rule": bound.rule, "kl": statistics.fmean(kl[i]),
                    "kl_second_half": statistics.fmean(kl[i][half:]), "top1": statistics.fmean(agree[i]),
                    "top1_second_half": statistics.fmean(agree[i][half:]),
                    "tokens_per_s": (continuation - 1) / seconds[i + 1],
                    "kv_bytes_allocated": sum(layer.nbytes() for layer in row.cache.layers),
                    **{k: v for k, v in row.bound.stats().items() if k in ("kv_entries_max", "kv_evictions",
                                                                            "kv_evict_s")}})
    return out


def summary(lines: list[dict]) -> str:
    """Means over records per (bound, rule)."""
    groups: dict = {}
    for line in lines:
        for row in line["rows"]:
            groups.setdefault((row["bound"] or 1 << 30, row["rule"]), []).append(row)
    head = ("| bound | rule | records | KL (nats) | KL 2nd half | top-1 | top-1 2nd half | peak entries | "
            "evictions | evict s | tok/s | KV MiB alloc |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = []
    for (bound, rule), rows in sorted(groups.items()):
        m = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
        if rule == "full":
            body.append(f"| - | full | {len(rows)} | 0 | 0 | 1.000 | 1.000 | - | - | - | {m('tokens_per_s'):.1f} | "
                        f"{m('kv_bytes_allocated') / 2**20:.2f} |")
            continue
        peak = max(max(r["kv_entries_max"]) for r in rows)
        body.append(f"| {bound} | {rule} | {len(rows)} | {m('kl'):.4f} | {m('kl_second_half'):.4f} | {m('top1'):.3f} | "
                    f"{m('top1_second_half'):.3f} | {peak} | {m('kv_evictions'):.0f} | {m('kv_evict_s'):.2f} | "
                    f"{m('tokens_per_s'):.1f} | {m('kv_bytes_allocated') / 2**20:.2f} |")
    return head + "\n".join(body) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--tasks", default="gov_report")
    p.add_argument("--first", type=int, default=0, help="first record of each task")
    p.add_argument("--records", type=int, default=1, help="records per task")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (middle-truncated)")
    p.add_argument("--continuation", type=int, default=1024)
    p.add_argument("--bounds", default="256,512,1024")
    p.add_argument("--rules", default="window,redundancy,recent,centrality")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, required=True, help="records.jsonl (one line per record; resumes)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    bounds = [DecodeBound(int(b), r) for b in args.bounds.split(",") for r in args.rules.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(x) for x in args.out.read_text().splitlines()] if args.out.exists() else []
    seen = {(d["task"], d["index"]) for d in done}
    for task in args.tasks.split(","):
        for rec in longbench.load(task, model.tokenizer, args.context, samples=args.records, first=args.first):
            if (task, rec["index"]) in seen:
                continue
            t0 = time.perf_counter()
            rows = measure(model, rec["input_ids"], args.continuation, bounds)
            line = {"task": task, "index": rec["index"], "model": args.model, "prompt_tokens": len(rec["input_ids"]),
                    "continuation": args.continuation, "threads": torch.get_num_threads(), "rows": rows}
            with args.out.open("a") as f:  # one whole line per record: a crash loses at most the record in flight
                f.write(json.dumps(line) + "\n")
            done.append(line)
            print(f"{task} #{rec['index']}: {time.perf_counter() - t0:.0f} s", flush=True)
    write_text_atomic(args.out.with_suffix(".md"), f"# KV bound over a {args.continuation}-token continuation, "
                      f"{args.model}, {args.tasks} from record {args.first}\n\n" + summary(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
