"""Per-layer attention statistics and answer-token ranks on real prompts: the evidence behind the
pivot detector and the cross-layer KV retention (docs/methods.md, "StructKV here").

For each prompt (RULER samples of the development split, `--seed`), every layer runs on all
tokens and reports, averaged over prompts:
- the detector's statistics over the ranked columns (no sink, no window): normalised entropy H of
  the window-averaged attention, top-k mass rho (k = --topk of the ranked columns), n * var(p);
- the share of window attention that lands on the first token (the sink);
- answer recall: the fraction of the gold answer's prompt tokens inside the top `--keep` of the
  ranked columns by that layer's pooled saliency S^(l), and by the decayed sum C up to it.

    python research/experiments/pivot_curves.py --model smollm2 --chat --lengths 2048 --samples 4 \
        --tasks niah_single_1,niah_multikey_1,qa_1 --seed 7
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

import structkv
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.modules import pooled_saliency
from structkv.runtime.compress import compress_shared


def answer_columns(tokenizer, ids: list[int], outputs: list[str]) -> list[int]:
    """Prompt columns of every gold answer's tokens (its first occurrence, with or without a space)."""
    cols = []
    for answer in outputs:
        for text in (" " + answer, answer):
            needle = tokenizer.encode(text, add_bos=False)
            hit = next((i for i in range(len(ids) - len(needle) + 1) if ids[i:i + len(needle)] == needle), None)
            if hit is not None:
                cols += range(hit, hit + len(needle))
                break
    return cols


def ranked_stats(saliency: torch.Tensor, window: int, sinks: int, topk: float) -> tuple[float, float, float]:
    """(H, rho, n var) of the window attention over the ranked columns of one row: saliency (Hkv, n)."""
    s = saliency.sum(0)[sinks: saliency.shape[-1] - window].double()
    p = s / s.sum().clamp_min(1e-30)
    n = p.numel()
    h = float(-(p * p.clamp_min(1e-30).log()).sum() / math.log(n))
    k = max(1, math.ceil(topk * n))
    return h, float(p.topk(k).values.sum()), float(n * ((p - 1 / n) ** 2).sum())


@torch.inference_mode()
def curves(model, ids: list[int], answer: list[int], window: int, sinks: int, topk: float, keep: float,
           decay: float) -> list[dict]:
    tokens = torch.tensor([ids])
    rows, n = [], len(ids)
    k_keep = int(keep * n)
    centrality = torch.zeros(n)
    ranked = torch.zeros(n, dtype=torch.bool)
    ranked[sinks:n - window] = True

    def observe(view):  # every layer of the one prefill loop, uncompressed
        nonlocal centrality
        if view.layer not in model.config.full_attention_layers:
            return
        sal = view.window_scores(window)  # (1, Hkv, n)
        pooled = pooled_saliency(sal, window, 7, "max")[0].sum(0)  # (n,)
        centrality = decay * centrality + pooled
        h, rho, var = ranked_stats(sal[0], window, sinks, topk)
        sink = float(sal[0].sum(0)[0] / sal[0].sum())

        def recall(score):
            top = torch.where(ranked, score, torch.tensor(-1.0)).topk(k_keep).indices.tolist()
            return sum(c in set(top) for c in answer) / max(1, len(answer))
        rows.append({"layer": view.layer, "H": h, "rho": rho, "V": var, "sink": sink, "recall_S": recall(pooled),
                     "recall_C": recall(centrality)})

    compress_shared(model, tokens, torch.arange(n)[None], [structkv.Full()], room=0,
                    timer=structkv.util.timing.NO_TIMER, observe=observe)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, default=2048)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tasks", default="niah_single_1,niah_multikey_1,qa_1")
    p.add_argument("--seed", type=int, default=7, help="7: the development split (42, the eval default, confirms)")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--topk", type=float, default=0.01)
    p.add_argument("--keep", type=float, default=0.1, help="top fraction for the answer recall")
    p.add_argument("--decay", type=float, default=0.9)
    p.add_argument("--json", default=None, help="write every prompt's curves here")
    args = p.parse_args(argv)
    model = structkv.load(args.model)
    cfg = EvalConfig(benchmark="ruler", model=args.model, tasks=args.tasks.split(","), samples=args.samples,
                     lengths=[args.lengths], seed=args.seed, chat=args.chat)
    every = []
    for sample in build_samples(cfg, model.tokenizer):
        answer = answer_columns(model.tokenizer, sample["input_ids"], sample["outputs"])
        rows = curves(model, sample["input_ids"], answer, args.window, args.sinks, args.topk, args.keep, args.decay)
        every.append({"task": sample["task"], "index": sample["index"], "answer_tokens": len(answer), "rows": rows})
        print(f"{sample['task']} #{sample['index']}: {len(answer)} answer tokens", file=sys.stderr)
    layers = [r["layer"] for r in every[0]["rows"]]
    keys = ["H", "rho", "V", "sink", "recall_S", "recall_C"]
    print(f"# {args.model}, {args.lengths} tokens, {len(every)} prompts (seed {args.seed}), means over prompts\n")
    print("| layer | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for j, layer in enumerate(layers):
        vals = [sum(e["rows"][j][k] for e in every) / len(every) for k in keys]
        print(f"| {layer} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    if args.json:
        structkv.util.files.write_text_atomic(args.json, json.dumps(every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
