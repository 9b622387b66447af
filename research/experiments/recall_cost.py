"""What ask-time recall costs: the added time per question and the RAM of hot set + archive.

For each context (the many-questions task's documents, `niah_many`) and each of its questions,
the question is appended to the compressed state twice, alternated in one process: without
recall (a copy of the hot set extended by the question: the question's own prefill) and with
recall (the question attends over hot set + archive and re-selects). Printed per setting: the
median ratio of the two times (recall / plain) over every question, with its pairs, and the bytes
of the hot set, of the archive and of the bf16 full cache (the same context's every entry at 2
bytes a value), as a fraction of the last.

    python research/experiments/recall_cost.py --model gemma-3-270m --length 4096 --contexts 2 \
        --method structkv_agnostic --kv-budget 0.1 --recall 0.1 --archive int4 --kv-dtype int8
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.runtime.compress import compress
from structkv.runtime.generation import _extend_state
from structkv.text.prompts import encode_batch


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--method", default="structkv_agnostic")
    p.add_argument("--kv-budget", default="0.1")
    p.add_argument("--struct-budget", default=None, help="R_struct (StructKV's skeleton); default: the method's own")
    p.add_argument("--recall", default="0.1")
    p.add_argument("--archive", default="int4")
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = structkv.load(args.model, kv_dtype=args.kv_dtype)
    cfg = EvalConfig("ruler", model=args.model, tasks=["niah_many"], samples=4 * args.contexts, lengths=[args.length],
                     seed=args.seed, question_after=True, chat=args.chat)
    samples = build_samples(cfg, model.tokenizer)
    method = methods.build(args.method, kv=args.kv_budget, struct=args.struct_budget)
    ratios, hot, archive, full = [], [], [], []
    for c in range(args.contexts):
        context = samples[4 * c]["input_ids"]
        tokens, positions, _ = encode_batch(model, [context])
        room = max(len(s["question_ids"]) for s in samples[4 * c:4 * c + 4]) + 32
        state = compress(model, tokens, positions, method, room=room, archive=args.archive)
        state.recall = methods.Budget.parse(args.recall, "recall").value
        head_dim = model.config.head_dim
        entries = sum(compress(model, tokens, positions, methods.get("full"), room=0).cache.entries())
        full.append(entries * 2 * head_dim * 2)  # K and V, bf16
        hot.append(sum(state.cache.nbytes()))
        archive.append(state.archive.nbytes())
        for s in samples[4 * c:4 * c + 4]:
            q = s["question_ids"]
            _extend_state(model, state, q, 32, 0)  # warm both paths once
            _extend_state(model, state, q, 32, None)
            plain = [timed(lambda: _extend_state(model, state, q, 32, 0)) for _ in range(3)]
            recall = [timed(lambda: _extend_state(model, state, q, 32, None)) for _ in range(3)]
            ratios.append(statistics.median(recall) / statistics.median(plain))
            print(f"context {c} question {s['index']}: {len(q)} tokens, plain {statistics.median(plain) * 1e3:.1f} ms, "
                  f"with recall {statistics.median(recall) * 1e3:.1f} ms, ratio {ratios[-1]:.2f}", flush=True)
    f = statistics.mean(full)
    print(f"\n| model | method | R_KV | R_struct | recall | archive | KV entries | hot / bf16 full | "
          f"archive / bf16 full | hot + archive / bf16 full | "
          f"question time with / without recall (median, {len(ratios)} questions) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} {args.length} | {args.method} | {args.kv_budget} | {args.struct_budget or 'default'} | "
          f"{args.recall} | {args.archive} | "
          f"{args.kv_dtype or 'model dtype'} | {statistics.mean(hot) / f:.3f} | {statistics.mean(archive) / f:.3f} | "
          f"{(statistics.mean(hot) + statistics.mean(archive)) / f:.3f} | {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}, {max(ratios):.2f}] |")


if __name__ == "__main__":
    main()
