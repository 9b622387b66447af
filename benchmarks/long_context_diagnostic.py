"""Where a compressed-once context loses its answers at length (a diagnostic: it chooses nothing).

The question after compression, on the many-questions task (`niah_many`: four facts planted in
essays, four questions asked from one compressed state) or any RULER task (`--tasks`, one
question per context). Each context is compressed once, in one shared prefill pass, into several
states that differ in one thing each from the default path (the model kind's hot set at R_KV
0.1, R_struct 0.2, an int4 archive, recall 0.2):

- `default`: the default path, asked with recall 0 (the hot set alone), 1024 entries, 0.2, 0.4 and 1.0;
- `bf16`: the same state with a bf16 archive (the archive's rounding);
- `rs1`: no token pruning (R_struct 1.0: every layer past the pivot computed for every token, so
  the deeper layers' archives and the sliding layers' windows hold everything), int4 archive;
- `rs1_bf16`: both; recall 1.0 here reads every entry exactly, so it must answer as the full cache.

Per question and state: the greedy answer (scored as `structkv eval` scores it), the gold
answer's mean negative log-likelihood teacher-forced after the question (moves smoothly where
accuracy flips on one token), and the question's last hidden state after every layer against the
full cache's (relative L2 error), reported by layer kind: sliding / full attention, before /
past the pivot. Records go to `--out` as JSON lines, one context at a time, so a run resumes.

    python benchmarks/long_context_diagnostic.py --model gemma-3-270m --length 16384 --seed 11 \
        --contexts 4 --max-new-tokens 16 --threads 1 --out research/results/long_context/dev_many_16384_s11.jsonl
    python benchmarks/long_context_diagnostic.py --tasks qa_1,qa_2,vt,niah_multikey_2,niah_multikey_3,niah_multivalue \
        --length 32768 --seed 11 --contexts 1 --threads 1 --out research/results/long_context/dev_ruler_32768_s11.jsonl
    python benchmarks/long_context_diagnostic.py --report research/results/long_context/dev_many_16384_s11.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig, build_samples, score
from structkv.runtime.compress import compress_shared
from structkv.runtime.decoding import Decoding, decode_tokens
from structkv.runtime.generation import _extend_state, _question_ids
from structkv.text.prompts import encode_batch

# name: (R_struct, archive kind, recall budgets asked)
VARIANTS = {
    "default": ("0.2", "int4", (0, 1024, 0.2, 0.4, 1.0)),
    "bf16": ("0.2", "bf16", (0.2, 1.0)),
    "rs1": ("1.0", "int4", (0.2, 1.0)),
    "rs1_bf16": ("1.0", "bf16", (0.2, 1.0)),
}


class LastHidden:
    """Forward hooks on every decoder layer keeping the last token's output of the latest call."""

    def __init__(self, model):
        self.rows: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.model.layers)]

    def _hook(self, i):
        def keep(module, args, out):
            self.rows[i] = out[0][:, -1].detach().float().clone()  # (B, E)
        return keep

    def take(self) -> list[torch.Tensor]:
        rows, self.rows = [self.rows[i] for i in sorted(self.rows)], {}
        return rows


def ask(model, state, question: list[int], gold: list[int], recall, cap: int, hidden: LastHidden) -> dict:
    """The greedy answer, the gold NLL and the per-layer last hidden states of one question
    (`recall` 0: the hot set alone, or the full cache's plain extension)."""
    room = max(cap, len(gold))  # the greedy answer, then the gold one, each on its own copy
    t0 = time.perf_counter()
    cache, logits, pos, _ = _extend_state(model, state, question, room, recall=recall)
    asked = time.perf_counter() - t0  # the question's pass (with recall: over hot set + archive)
    layers = hidden.take()
    out, _ = decode_tokens(Decoding(model, cache, logits, pos), cap)
    cache, logits, pos, _ = _extend_state(model, state, question, room, recall=recall)
    rows = Decoding(model, cache, logits, pos)
    nll = 0.0
    for t in gold:  # teacher-forced: the gold answer's tokens after the question
        nll -= torch.log_softmax(rows.logits[0], -1)[t].item()
        rows.feed(torch.tensor([t]))
    hidden.take()
    return {"answer": out[0], "nll": nll / len(gold), "hidden": layers, "question_s": asked}


def contexts(samples: list[dict]) -> list[list[dict]]:
    """Samples grouped by the context they ask about (niah_many: four questions each; RULER's
    other tasks: one), in order."""
    groups = []
    for s in samples:
        if groups and groups[-1][0]["input_ids"] == s["input_ids"] and groups[-1][0]["task"] == s["task"]:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def gold_ids(tokenizer, sample: dict) -> list[int]:
    """The gold answer as the model would write it after the answer prefix (every value of a
    multi-value answer, comma-separated), at most its first 64 tokens."""
    return tokenizer.encode(" " + ", ".join(o.strip() for o in sample["outputs"]), add_bos=False)[:64]


def layer_kinds(model, pivot) -> list[str]:
    """Each layer's kind: sliding / full attention, before (<=) / past (>) the pivot."""
    kinds = []
    for i, t in enumerate(model.config.layer_types):
        where = "past" if pivot is not None and i > pivot else "before"
        kinds.append(f"{'sliding' if t == 'sliding_attention' else 'full'}_{where}")
    return kinds


def run(args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {json.loads(line)["context"] for line in out.read_text().splitlines() if line.strip()}
    model = structkv.load(args.model)
    name, kv = methods.context_default(model.config)
    tasks = args.tasks.split(",")
    if "niah_many" in tasks and len(tasks) > 1:
        raise SystemExit("niah_many asks four questions a context: run it on its own (--tasks niah_many)")
    per_task = args.contexts * (4 if tasks == ["niah_many"] else 1)  # samples are questions
    cfg = EvalConfig("ruler", model=args.model, tasks=tasks, samples=per_task,
                     lengths=[args.length], seed=args.seed, question_after=True, chat=args.chat)
    hidden = LastHidden(model)
    for c, group in enumerate(contexts(build_samples(cfg, model.tokenizer))):
        if c in done:
            continue
        t0 = time.perf_counter()
        tokens, positions, _ = encode_batch(model, [group[0]["input_ids"]])
        golds = [gold_ids(model.tokenizer, s) for s in group]
        room = max(len(s["question_ids"]) + 2 for s in group) + args.max_new_tokens + max(map(len, golds))
        members = [methods.get("full")] + [methods.build(name, kv=kv, struct=rs) for rs, _, _ in VARIANTS.values()]
        kinds = [None] + [arch for _, arch, _ in VARIANTS.values()]
        states = compress_shared(model, tokens, positions, members, room=room, archive=kinds)
        prefill_s = time.perf_counter() - t0
        full, named = states[0], dict(zip(VARIANTS, states[1:]))
        pivot = named["default"].stats.pivot_layer
        D = model.config.head_dim
        full_bytes = sum(full.cache.entries()) * 4 * D  # K and V in bf16
        share = {v: (sum(st.cache.entries()) * (2 * D + 8) + st.archive.nbytes()) / full_bytes  # hot set as int8
                 for v, st in named.items()}
        records = []
        for j, s in enumerate(group):
            question = _question_ids(model, s["question_ids"])
            cap = min(args.max_new_tokens, s["max_new_tokens"])
            ref = ask(model, full, question, golds[j], 0, cap, hidden)
            runs = [("full", None, full)] + [(v, r, named[v]) for v, (_, _, rs) in VARIANTS.items() for r in rs]
            for label, recall, state in runs:
                got = ref if label == "full" else ask(model, state, question, golds[j], recall, cap, hidden)
                text = model.tokenizer.decode(got["answer"])
                drift = [((a - b).norm() / b.norm()).item() for a, b in zip(got["hidden"], ref["hidden"])]
                records.append({"context": c, "task": s["task"], "question": j, "variant": label, "recall": recall,
                                "score": score(s, text), "answer": text, "gold": s["outputs"][0],
                                "nll": got["nll"], "drift": drift, "kept_share": share.get(label, 1.0),
                                "question_s": got["question_s"],
                                "pivot": pivot, "kinds": layer_kinds(model, pivot), "prefill_s": prefill_s,
                                "length": len(group[0]["input_ids"])})
        with out.open("a") as f:  # one context at a time: a killed run loses at most the context under way
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        print(f"context {c}: {len(group[0]['input_ids'])} tokens, pivot {pivot}, "
              f"{time.perf_counter() - t0:.0f} s (prefill {prefill_s:.0f} s)", flush=True)


def report(paths: list[str]) -> str:
    rows = [{**json.loads(line), "context": (i, json.loads(line)["context"])}  # contexts of several files apart
            for i, p in enumerate(paths) for line in Path(p).read_text().splitlines() if line.strip()]
    if not rows:
        return "no records"
    full = {(r["context"], r["question"]): r for r in rows if r["variant"] == "full"}
    keys = []
    for r in rows:
        k = (r["variant"], r["recall"])
        if k not in keys:
            keys.append(k)
    kinds = rows[0]["kinds"]
    groups = list(dict.fromkeys(kinds))
    n = len(full)
    sizes = sorted({r["length"] for r in rows})
    lines = [f"{n} questions over {len({r['context'] for r in rows})} contexts of "
             f"{sizes[0]}{'' if len(sizes) == 1 else f'-{sizes[-1]}'} tokens; "
             f"pivot {sorted({r['pivot'] for r in rows}, key=str)}",
             "",
             "| state | recall | accuracy | - full [95 %] | answers = full's | hot + archive / bf16 full | "
             "question pass, s (median) | gold NLL | NLL - full [95 %] | "
             + " | ".join(f"drift {g} (last layer)" for g in groups) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(groups)]
    for variant, recall in keys:
        sel = [r for r in rows if r["variant"] == variant and r["recall"] == recall]
        acc = 100 * sum(r["score"] for r in sel) / len(sel)
        same = sum(r["answer"].strip() == full[(r["context"], r["question"])]["answer"].strip() for r in sel)
        nll = sum(r["nll"] for r in sel) / len(sel)
        diffs = [r["nll"] - full[(r["context"], r["question"])]["nll"] for r in sel]
        lo, hi = _interval(diffs)
        drift = []
        for g in groups:
            last = max(i for i, k in enumerate(kinds) if k == g)
            drift.append(sum(r["drift"][last] for r in sel) / len(sel))
        kept = [r["kept_share"] for r in sel if "kept_share" in r]
        kept = f"{sum(kept) / len(kept):.3f}" if kept else "-"
        took = sorted(r["question_s"] for r in sel if "question_s" in r)
        took = f"{took[len(took) // 2]:.2f}" if took else "-"
        gaps = [100 * (r["score"] - full[(r["context"], r["question"])]["score"]) for r in sel]
        glo, ghi = _interval(gaps)
        lines.append(f"| {variant} | {'-' if recall is None else recall} | {acc:.1f} | "
                     f"{sum(gaps) / len(gaps):+.1f} [{glo:+.1f}, {ghi:+.1f}] | {same}/{len(sel)} | {kept} | "
                     f"{took} | "
                     f"{nll:.3f} | "
                     f"{sum(diffs) / len(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                     + " | ".join(f"{d:.3f}" for d in drift) + " |")
    tasks = list(dict.fromkeys(r.get("task", "niah_many") for r in rows))
    if len(tasks) > 1:  # accuracy per task: which kinds of question lose
        lines += ["", "| state | recall | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
        for variant, recall in keys:
            cells = []
            for t in tasks:
                sel = [r for r in rows if r["variant"] == variant and r["recall"] == recall
                       and r.get("task", "niah_many") == t]
                cells.append(f"{100 * sum(r['score'] for r in sel) / len(sel):.0f}" if sel else "")
            lines.append(f"| {variant} | {'-' if recall is None else recall} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95 % interval of the mean (fixed seed: the report is reproducible)."""
    import random

    rng = random.Random(0)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(draws))
    return means[int(0.025 * draws)], means[min(draws - 1, math.ceil(0.975 * draws) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--seed", type=int, default=11, help="a development seed (confirmation runs use others)")
    p.add_argument("--tasks", default="niah_many", help="RULER tasks (comma-separated); niah_many asks 4 a context")
    p.add_argument("--contexts", type=int, default=4, help="contexts per task")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=32, help="cap on each answer (and the task's own)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="JSON lines, appended one context at a time (a rerun resumes)")
    p.add_argument("--report", nargs="+", help="print the table of these record files and exit")
    args = p.parse_args()
    if args.report:
        print(report(args.report))
        return
    if not args.out:
        p.error("--out is required to run")
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
