"""Task accuracy of a KV bound on long outputs: scored summaries and a many-turn chat.

`decode_bound.py` measures how far a bound moves the next-token distribution on a teacher-forced
continuation; this measures what users see. Two tasks, each run with the full cache and with each
(bound, rule), greedy, in one process so speeds compare:

- `summary`: LongBench `gov_report` / `multi_news` records (prompt middle-truncated to `--context`
  tokens), the summary generated up to `--new-tokens` (stopping at EOS), scored by LongBench's
  ROUGE-L against the reference.
- `chat`: one conversation per session, kept in one cache for its whole length (as a chat server
  keeps it): turn 1 gives four facts ("the code of the red locker is 4821"), `--turns` turns ask
  for a paragraph each (the answers grow the cache past the bound), the last turn asks for one
  fact from turn 1. Every user turn is fed through the bounded decode step, token by token, so
  the bound holds over the whole session. Scored 1 when the answer contains the code. Needs a
  model with a chat template (`--model smollm2`).

Per row: the score, new tokens, decode tokens/s, peak entries per layer, evictions and KV bytes
allocated at the end. Resumes: rows already in `--out` (one line per record or session and
setting) are skipped; `--out`'s `.md` table is rewritten.

    python research/experiments/long_output.py summary --model gemma-3-270m --tasks gov_report,multi_news \\
        --records 2 --context 1024 --new-tokens 512 --bounds 256,512,1024 --rules centrality,recent \\
        --out research/results/long_output/summary_gemma.jsonl
    python research/experiments/long_output.py chat --model smollm2 --sessions 6 --turns 8 --bounds 256,512,1024 \\
        --rules centrality,recent --out research/results/long_output/chat_smollm2.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import structkv
from structkv.harness.eval import longbench
from structkv.harness.eval.metrics import longbench_score
from structkv.modules import DecodeBound
from structkv.runtime.decoding import Decoding, bounded, eos_ids
from structkv.runtime.generation import start
from structkv.text import chat
from structkv.util.files import write_text_atomic

COLOURS = ["red", "blue", "green", "amber", "violet", "grey", "white", "black", "gold", "silver", "orange", "pink"]
TOPICS = ["the history of tea", "how bridges carry weight", "why the sky is blue", "the life of bees",
          "how a compass works", "the first printing presses", "how rain forms", "the rules of chess",
          "how bread rises", "the planets of the solar system", "how trains run on rails", "the Roman roads",
          "how volcanoes erupt", "the invention of paper", "how the heart pumps blood", "the tides of the sea"]


def settings(bounds: str, rules: str) -> list[DecodeBound | None]:
    """The full cache first, then every (bound, rule)."""
    return [None, *(DecodeBound(int(b), r) for b in bounds.split(",") for r in rules.split(","))]


def bound_stats(run: Decoding) -> dict:
    kv = {"kv_bytes_allocated": sum(layer.nbytes() for layer in run.cache.layers)}
    if run.bound is None:
        return kv
    s = run.bound.stats()
    return kv | {"kv_entries_max": max(s["kv_entries_max"]), "kv_evictions": s["kv_evictions"],
                 "kv_evict_s": s["kv_evict_s"]}


@torch.inference_mode()
def answer(run: Decoding, max_new: int, stops: set[int]) -> tuple[list[int], float]:
    """Greedy tokens until a stop token (fed, so the turn closes in the cache) or `max_new`."""
    out, t0 = [], time.perf_counter()
    for _ in range(max_new):
        tok = run.logits.argmax(-1)  # (1,)
        out.append(int(tok))
        run.feed(tok)
        if out[-1] in stops:
            break
    return out, time.perf_counter() - t0


@torch.inference_mode()
def summary_row(model, rec: dict, task: str, bound, new_tokens: int) -> dict:
    first = start(model, rec["input_ids"], max_new_tokens=new_tokens, bound=bound)
    run = Decoding(model, first.cache, first.logits, first.next_pos, bound=bounded(model, first.cache, bound))
    ids, seconds = answer(run, new_tokens, set(eos_ids(model)))
    text = model.tokenizer.decode([t for t in ids if t not in eos_ids(model)])
    return {"score": longbench_score(task, text, rec["outputs"], rec.get("all_classes")), "new_tokens": len(ids),
            "tokens_per_s": len(ids) / seconds, "prediction": text[:2000], **bound_stats(run)}


def session(seed: int, turns: int) -> tuple[list[str], str]:
    """The user turns of one conversation and the code its last turn asks for."""
    rng = random.Random(seed)
    colours = rng.sample(COLOURS, 4)
    codes = [str(rng.randrange(1000, 10000)) for _ in colours]
    facts = " ".join(f"The code of the {c} locker is {n}." for c, n in zip(colours, codes))
    asked = rng.randrange(4)
    user = [f"Please remember these locker codes for later. {facts} Reply with OK.",
            *(f"Write a short paragraph about {t}." for t in rng.sample(TOPICS, turns)),
            f"Earlier I told you some locker codes. What is the code of the {colours[asked]} locker? "
            "Answer with the number only."]
    return user, codes[asked]


def closing(tok, history: list[dict]) -> list[int]:
    """Token ids the chat template writes after the last (assistant) message's content."""
    before = chat.render(tok, history[:-1]) + history[-1]["content"]
    after = chat.render(tok, history, add_generation_prompt=False)
    if not after.startswith(before):
        raise ValueError("this chat template rewrites an assistant turn's content; the chat task cannot feed it")
    return tok.encode(after[len(before):], add_bos=False)


@torch.inference_mode()
def chat_row(model, seed: int, turns: int, bound, new_tokens: int, answer_tokens: int = 24) -> dict:
    tok = model.tokenizer
    user, code = session(seed, turns)
    history = [{"role": "user", "content": user[0]}]
    total = len(chat.encode(tok, history)) + sum(len(tok.encode(u, add_bos=False)) + 16 for u in user[1:]) \
        + new_tokens * (turns + 1) + answer_tokens
    first = start(model, chat.encode(tok, history), max_new_tokens=total, bound=bound)
    run = Decoding(model, first.cache, first.logits, first.next_pos, bound=bounded(model, first.cache, bound))
    stops, made, seconds = set(eos_ids(model)), 0, 0.0
    for i, text in enumerate(user[1:], 1):
        ids, s = answer(run, answer_tokens if i == len(user) else new_tokens, stops)
        made, seconds = made + len(ids), seconds + s
        history.append({"role": "assistant", "content": tok.decode([t for t in ids if t not in stops])})
        close = closing(tok, history)
        if ids[-1] in stops and close[:1] == ids[-1:]:
            close = close[1:]  # the end-of-turn token the model wrote is already in the cache
        for t in close + chat.continuation(tok, history, [{"role": "user", "content": text}]):
            run.feed(torch.tensor([t]))  # the turn's closing and the next user turn, through the bounded step
        history.append({"role": "user", "content": text})
    ids, s = answer(run, answer_tokens, stops)
    reply = tok.decode([t for t in ids if t not in stops])
    return {"score": float(code in reply), "gold": code, "prediction": reply, "new_tokens": made + len(ids),
            "session_tokens": int(run.positions.max()), "tokens_per_s": (made + len(ids)) / (seconds + s),
            **bound_stats(run)}


def table(lines: list[dict]) -> str:
    groups: dict = {}
    for line in lines:
        groups.setdefault((line["bound"] or 0, line["rule"]), []).append(line)  # the full cache first
    out = ["| bound | rule | n | score | new tokens | tok/s | peak entries | evictions | KV MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (bound, rule), rows in sorted(groups.items()):
        m = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
        peak = max(r.get("kv_entries_max", 0) for r in rows) if rule != "full" else "-"
        ev = f"{m('kv_evictions'):.0f}" if rule != "full" else "-"
        out.append(f"| {bound if rule != 'full' else '-'} | {rule} | {len(rows)} | {100 * m('score'):.1f} | "
                   f"{m('new_tokens'):.0f} | {m('tokens_per_s'):.1f} | {peak} | {ev} | "
                   f"{m('kv_bytes_allocated') / 2**20:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=("summary", "chat"))
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--tasks", default="gov_report,multi_news", help="summary: LongBench tasks")
    p.add_argument("--first", type=int, default=0, help="summary: first record of each task")
    p.add_argument("--records", type=int, default=2, help="summary: records per task")
    p.add_argument("--context", type=int, default=1024, help="summary: prompt tokens (middle-truncated)")
    p.add_argument("--sessions", type=int, default=6, help="chat: conversations (seeds 0..n-1)")
    p.add_argument("--turns", type=int, default=8, help="chat: paragraph turns between the facts and the question")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per answer (summary 512, chat 96)")
    p.add_argument("--bounds", default="256,512,1024")
    p.add_argument("--rules", default="centrality")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = structkv.load(a.model)
    if a.task == "chat" and not model.tokenizer.chat_template:
        raise SystemExit(f"{a.model} has no chat template: the chat task needs an instruct model (--model smollm2)")
    new_tokens = a.new_tokens or (512 if a.task == "summary" else 96)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(x) for x in a.out.read_text().splitlines()] if a.out.exists() else []
    seen = {(d["item"], d["bound"], d["rule"]) for d in done}
    if a.task == "summary":
        items = [(f"{t}#{r['index']}", (r, t)) for t in a.tasks.split(",")
                 for r in longbench.load(t, model.tokenizer, a.context, samples=a.records, first=a.first)]
    else:
        items = [(f"session#{s}", s) for s in range(a.sessions)]
    for item, spec in items:
        for bound in settings(a.bounds, a.rules):
            key = (item, bound and bound.max_tokens, bound.rule if bound else "full")
            if key in seen:
                continue
            row = summary_row(model, *spec, bound, new_tokens) if a.task == "summary" \
                else chat_row(model, spec, a.turns, bound, new_tokens)
            line = {"item": item, "bound": key[1], "rule": key[2], "model": a.model,
                    "threads": torch.get_num_threads(), **row}
            with a.out.open("a") as f:  # one whole line per row: a crash loses at most the row in flight
                f.write(json.dumps(line) + "\n")
            done.append(line)
            print(f"{item} {key[2]}@{key[1]}: score {row['score']:.3f}, {row['new_tokens']} tokens, "
                  f"{row['tokens_per_s']:.1f} tok/s", flush=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    write_text_atomic(a.out.with_suffix(".md"), f"# Long outputs under a KV bound: {a.task}, {a.model}\n\n"
                      f"`python research/experiments/long_output.py {command}`\n\n" + table(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
