"""How much each archive encoding changes what a question reads: per full-attention layer, the
question tokens' attention over the context's keys and values encoded one way, against the exact
entries (one uncompressed pass of context + question, the many-questions task).

Why: on the development prompts a bf16 archive gives the full cache's answers where the int4
archive loses some (research/results/README.md, "Where the int4 archive loses"), so the 4-bit encoding, not the
selection, is the loss; this instrument compares encodings without an accuracy run. Printed per
layer: the mean KL (nats) of the question's attention distribution over the context, the
relative L2 error of its attention output, and the share of the exact top-32 context entries
(by attention summed over the question) that the encoded keys also rank top-32.

    python research/experiments/archive_fidelity.py --model gemma-3-270m --length 4096 --seed 8 --contexts 2
"""
from __future__ import annotations

import argparse

import torch

import structkv
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.models import archive as kv_archive
from structkv.runtime.generation import _question_ids

TOP = 32


def encoded(x: torch.Tensor, kind: str, side: str) -> torch.Tensor:
    """x (Hkv, T, D) float32 -> the same entries as an archive of `kind` stores them, read back."""
    entries = x.transpose(0, 1)[:, None]  # (T, 1, Hkv, D): entries first, one row
    planes = list(kv_archive.encode(entries, kind, side))
    return kv_archive.decode_run(planes, kind, side)[:, 0].transpose(0, 1)  # (Hkv, T, D)


def entry_bytes(kind: str, D: int) -> float:
    """Bytes an entry's key and value take in `kind`, over one block of entries (per-channel tables)."""
    n = kv_archive.CHANNEL_BLOCK
    return sum(t.numel() * t.element_size() for side in "kv"
               for t in kv_archive.encode(torch.zeros(n, 1, D), kind, side)) / (2 * n)


def attention(q, k, v, n_ctx, scale):
    """q (Hq, S, D) over k, v (Hkv, T, D), the last S keys causal -> probabilities on the first
    n_ctx keys (Hq, S, n_ctx), every key's (Hq, S, T: the KL's distribution, which sums to 1) and
    the output (Hq, S, D)."""
    Hq, S, _ = q.shape
    G = Hq // k.shape[0]
    kk, vv = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)  # (Hq, T, D)
    logits = (q @ kk.transpose(1, 2)) * scale  # (Hq, S, T)
    T = k.shape[1]
    causal = torch.ones(S, T, dtype=torch.bool).tril(T - S)
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    return p[..., :n_ctx], p, p @ vv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--kinds", default="int4_token,int4,int8,bf16")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    full = [i for i, t in enumerate(model.config.layer_types) if t != "sliding_attention"]
    cfg = EvalConfig("ruler", model=args.model, tasks=["niah_many"], samples=4 * args.contexts, lengths=[args.length],
                     seed=args.seed, question_after=True, chat=args.chat)
    samples = build_samples(cfg, model.tokenizer)
    kinds = args.kinds.split(",")
    sums = {(kind, i): torch.zeros(3) for kind in kinds for i in full}
    for s in samples:
        ctx, ask = s["input_ids"], _question_ids(model, s["question_ids"])
        tokens = torch.tensor([ctx + ask])
        seen = {}

        def keep(i, h, pos, q, k, v):
            if i in full:
                seen[i] = (q[0, :, -len(ask):], k[0], v[0])  # the question's queries, every key and value

        with torch.inference_mode():
            model(tokens, torch.arange(tokens.shape[1])[None], on_layer=keep, last=True)
        for i in full:
            q, k, v = (t.float() for t in seen[i])
            scale = model.model.layers[i].self_attn.scale
            p_ref, all_ref, o_ref = attention(q, k, v, len(ctx), scale)
            top_ref = p_ref.sum((0, 1)).topk(TOP).indices
            for kind in kinds:
                n = len(ctx)
                k2 = torch.cat([encoded(k[:, :n], kind, "k"), k[:, n:]], 1)
                v2 = torch.cat([encoded(v[:, :n], kind, "v"), v[:, n:]], 1)
                p2, all2, o2 = attention(q, k2, v2, n, scale)
                kl = (all_ref * (all_ref.clamp_min(1e-30).log() - all2.clamp_min(1e-30).log())).sum(-1).mean()
                rel = ((o2 - o_ref).norm(dim=-1) / o_ref.norm(dim=-1)).mean()
                top = len(set(top_ref.tolist()) & set(p2.sum((0, 1)).topk(TOP).indices.tolist())) / TOP
                sums[(kind, i)] += torch.tensor([kl.item(), rel.item(), top])
    n = len(samples)
    print(f"\n{args.model}, {args.length} tokens, seed {args.seed}, {n} questions; per full-attention layer: "
          f"KL of the question's attention / relative output error / top-{TOP} overlap")
    print("| encoding | bytes per entry (D) | " + " | ".join(f"layer {i}" for i in full) + " |")
    print("|---|---|" + "---|" * len(full))
    D = model.config.head_dim
    for kind in kinds:
        nbytes = f"{entry_bytes(kind, D):g}"
        cells = [f"{a:.2e} / {b:.3f} / {c:.2f}" for a, b, c in (sums[(kind, i)] / n for i in full)]
        print(f"| {kind} | {nbytes} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
