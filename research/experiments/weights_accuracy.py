"""What quantized weights cost in accuracy: each `weights=` setting's next-token distributions
against float32's on real evaluation prompts, teacher-forced.

For every prompt (RULER and LongBench samples of the evaluation's own builders, seed 42), the
model reads the whole prompt once per weight setting; over the last `--positions` positions it
reports the mean KL(fp32 || quantized), top-1 agreement with fp32 and the float32 logit error.
Answers (RULER accuracy) are a separate run: `structkv eval ruler --weights int8 ...`.
A whole prompt runs the prompt path (the weight unpacked, a GEMM on float x); `--decode-kernels`
sends every row through the few-row kernels instead (structkv's tiled int8 / int4: x rounded to
int8 per group of 32 as in every decode step), so the KL is that of generation.

    python research/experiments/weights_accuracy.py --model gemma-3-270m --weights bf16,int8,int4 --length 4096
"""
from __future__ import annotations

import argparse
import json
import sys


def prompts(model, length: int, per_task: int, chat: bool) -> list[dict]:
    from structkv.harness.eval.runner import EvalConfig, build_samples

    out = []
    for bench, tasks in (("ruler", ["niah_single_2", "niah_multikey_1", "qa_1", "vt"]),
                         ("longbench", ["narrativeqa", "hotpotqa", "gov_report", "lcc"])):
        cfg = EvalConfig(benchmark=bench, model="-", lengths=[length], tasks=tasks, samples=per_task, chat=chat)
        out += build_samples(cfg, model.tokenizer)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--weights", default="bf16,int8,int4")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-kernels", action="store_true",
                    help="every product through the few-row kernels (x quantized per row, decode's numerics) "
                         "instead of the prompt's GEMM")
    args = ap.parse_args(argv)
    import torch

    import structkv

    torch.set_num_threads(args.threads)
    ref = structkv.load(args.model)
    samples = prompts(ref, args.length, args.per_task, args.chat)
    with torch.inference_mode():
        base = [ref(torch.tensor([s["input_ids"]]))[0, -args.positions:].log_softmax(-1) for s in samples]
    del ref
    if args.decode_kernels:  # the tiled ops take the GEMM from this many rows: never
        import structkv.models.quantized as quantized
        quantized.DENSE_ROWS = 1 << 40
    rows = []
    for w in args.weights.split(","):
        model = structkv.load(args.model, weights=w)
        kl, top1, err = [], [], []
        with torch.inference_mode():
            for s, b in zip(samples, base):
                q = model(torch.tensor([s["input_ids"]]))[0, -args.positions:].log_softmax(-1)
                kl.append((b.exp() * (b - q)).sum(-1).mean().item())
                top1.append((b.argmax(-1) == q.argmax(-1)).float().mean().item())
                err.append(((b - q).abs().max() / b.abs().max()).item())
        rows.append({"model": args.model, "weights": w, "prompts": len(samples), "positions": args.positions,
                     "length": args.length, "kl_mean": sum(kl) / len(kl), "kl_max": max(kl),
                     "top1_agreement": sum(top1) / len(top1), "max_rel_logprob_error": max(err)})
        print(json.dumps(rows[-1]), flush=True)
        del model
    print("\n| model | weights | KL to fp32 (mean / worst prompt) | top-1 agreement | prompts x positions |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['weights']} | {r['kl_mean']:.4f} / {r['kl_max']:.4f} | "
              f"{100 * r['top1_agreement']:.1f} % | {r['prompts']} x {r['positions']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
