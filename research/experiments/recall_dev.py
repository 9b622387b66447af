"""Development sweep of ask-time recall's pooling kernel (how far the question's picks spread to
their neighbours) on the many-questions task, question after compression.

Each context is compressed once per hot method with an archive; every question is answered with
recall at each kernel, greedy, scored as the eval scores it. Run on a development seed only (the
eval's confirmation runs use seed 42):

    python research/experiments/recall_dev.py --model gemma-3-270m --length 4096 --seed 7 --contexts 3 \
        --methods snapkv,keydiff,structkv_agnostic,streaming_llm --kv-budget 0.1 --recall 0.1 --kernels 7,15,31,63
"""
from __future__ import annotations

import argparse

import torch

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig, build_samples, score
from structkv.modules.recall import recall_extend
from structkv.runtime.compress import compress_shared
from structkv.runtime.decoding import Decoding, decode_tokens
from structkv.runtime.generation import _question_ids
from structkv.text.prompts import encode_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--contexts", type=int, default=3)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--methods", default="snapkv,keydiff,structkv_agnostic,streaming_llm")
    p.add_argument("--kv-budget", default="0.1")
    p.add_argument("--recall", default="0.1")
    p.add_argument("--archive", default="int4")
    p.add_argument("--kernels", default="7,15,31,63")
    p.add_argument("--max-new-tokens", type=int, default=16, help="cap on each answer (a 7-digit number needs ~10)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    cfg = EvalConfig("ruler", model=args.model, tasks=["niah_many"], samples=4 * args.contexts, lengths=[args.length],
                     seed=args.seed, question_after=True, chat=args.chat)
    samples = build_samples(cfg, model.tokenizer)
    names, kernels = args.methods.split(","), [int(k) for k in args.kernels.split(",")]
    recall = methods.Budget.parse(args.recall, "recall").value
    hits = {(n, k): 0 for n in names for k in kernels}
    for c in range(args.contexts):
        group = samples[4 * c:4 * c + 4]
        tokens, positions, _ = encode_batch(model, [group[0]["input_ids"]])
        room = max(len(s["question_ids"]) for s in group) + max(s["max_new_tokens"] for s in group)
        states = compress_shared(model, tokens, positions, [methods.build(n, kv=args.kv_budget) for n in names],
                                 room=room, archive=args.archive)
        for name, state in zip(names, states):
            for s in group:
                ids = _question_ids(model, s["question_ids"])
                q = torch.tensor([ids])
                pos = state.next_positions + torch.arange(len(ids))
                for k in kernels:
                    cache, logits, _ = recall_extend(model, state, q, pos, recall, kernel=k)
                    cap = min(args.max_new_tokens, s["max_new_tokens"])
                    out, _ = decode_tokens(Decoding(model, cache, logits, pos[:, -1:] + 1), cap)
                    hits[(name, k)] += score(s, model.tokenizer.decode(out[0]))
        done = 4 * (c + 1)
        print(f"after {done} questions: " + ", ".join(f"{n}/k{k} {100 * hits[(n, k)] / done:.0f}" for n in names
                                                        for k in kernels), flush=True)
    head = " | ".join(f"kernel {k}" for k in kernels)
    print(f"\n| hot method @ R_KV {args.kv_budget}, recall {args.recall} | {head} |")
    print("|---|" + "---|" * len(kernels))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{100 * hits[(n, k)] / (4 * args.contexts):.1f}" for k in kernels) + " |")


if __name__ == "__main__":
    main()
