"""Why a method misses a needle: per-layer saliency ranks of the needle and what each cache kept.

For each prompt: at every full-attention layer of the uncompressed model, the rank (1 = most
attended) of the needle's tokens under the pooled observation-window saliency; then, for each
method, which needle tokens survived propagation and which each full-attention layer's cache holds.

    python research/experiments/needle_diagnose.py --tokens 4096 --depths 0.1,0.5,0.9 --methods fastkv,structkv
"""
from __future__ import annotations

import argparse

import torch
from needle_methods import build

import structkv
from structkv.harness.eval.sources import needle_prompt
from structkv.models.decoder import run_block
from structkv.modules import pool_scores
from structkv.ops import window_scores
from structkv.runtime.compress import compress
from structkv.text.prompts import encode_batch


@torch.inference_mode()
def needle_ranks(model, ids, span, window=8, kernel=7):
    """{layer: (best rank, worst rank)} of the needle tokens in [span) at full-attention layers."""
    tokens, positions, _ = encode_batch(model, [ids])
    h, rope = model.embed(tokens), model.rope_tables(positions)
    n = tokens.shape[1]
    out = {}
    for i in range(model.config.num_layers):
        h, q, k, _ = run_block(model.model.layers[i], h, positions, *rope[model.config.layer_types[i]])
        if model.config.sliding_window_at(i) is None:
            sal = window_scores(q[:, :, -window:], k, positions[:, -window:].contiguous(), positions,
                                scale=model.config.scale)
            s = pool_scores(sal[:, :, : n - window], kernel, "max").sum(1)[0]  # (n - w,)
            order = torch.argsort(s, descending=True, stable=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(1, len(order) + 1)
            r = rank[span[0]:span[1]]
            out[i] = (int(r.min()), int(r.max()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--methods", default="fastkv,structkv")
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("--struct-budget", type=float, default=0.2)
    args = ap.parse_args()
    model = structkv.load(args.model)
    for j, d in enumerate(float(x) for x in args.depths.split(",")):
        nd = needle_prompt(model.tokenizer, args.tokens, d, seed=j)
        span = nd.needle_token_span
        print(f"\n## depth {d:.0%}: needle tokens {span[0]}..{span[1] - 1} of {len(nd.prompt_ids)}, answer {nd.answer}")
        ranks = needle_ranks(model, nd.prompt_ids, span)
        print("needle saliency rank (best, worst) per full-attention layer:",
              ", ".join(f"L{l}: {a}-{b}" for l, (a, b) in ranks.items()))
        for name in args.methods.split(","):
            method = build(name, args.kv_budget, args.struct_budget)
            tokens, positions, _ = encode_batch(model, [nd.prompt_ids])
            state = compress(model, tokens, positions, method, room=16)
            kept = set(state.kept_columns[0].tolist())
            survived = sum(c in kept for c in range(*span))
            cached = []
            for l in model.config.full_attention_layers:
                pos = state.cache.layers[l].pos[0]
                cached.append(f"L{l}: {sum(int((pos == p).any()) for p in range(*span))}/{span[1] - span[0]}")
            out = structkv.generate(model, nd.prompt_ids, max_new_tokens=12, compile=False, method=method)
            print(f"- {name}: pivot {state.stats.get('pivot_layer')}, needle tokens reaching the last layer "
                  f"{survived}/{span[1] - span[0]}, in cache {', '.join(cached)}; answer {out.text.strip()!r}")


if __name__ == "__main__":
    main()
