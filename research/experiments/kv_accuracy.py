"""What quantized KV entries cost: next-token distributions of int8 / int4 caches against the
float full cache, with and without eviction, teacher-forced, and the bytes each keeps.

For every prompt (RULER and LongBench samples of the evaluation's own builders, seed 42): the
prompt minus its last `--positions` tokens is prefilled once per kv_dtype (every method in one
shared pass, `compress_shared`), then the last `--positions` tokens are teacher-forced through
each cache (`Decoder.extend`, which reads the stored entries: dequantized ones when quantized).
Against the float full cache's distributions: mean KL, top-1 agreement; and the kept KV bytes
(scale tables included). Answers are a separate run: `structkv eval ruler --kv-dtype int8 ...`.

    python research/experiments/kv_accuracy.py --model gemma-3-270m --methods full,structkv,snapkv --kv-budget 0.1
"""
from __future__ import annotations

import argparse
import json
import sys


def teacher_forced(model, state, tokens: list[int]):
    """Log-probabilities (S, V) of each of `tokens` given the state and the tokens before it."""
    import torch

    cache = state.cache.clone()
    pos = state.next_positions + torch.arange(len(tokens) - 1)
    rest = model.extend(torch.tensor([tokens[:-1]]), pos[None] if pos.dim() == 1 else pos, cache, every=True)[0]
    return torch.cat([state.logits, rest]).float().log_softmax(-1)  # (S, V)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--kv-dtypes", default="int8,int4")
    ap.add_argument("--methods", default="full,structkv,snapkv")
    ap.add_argument("--kv-budget", default="0.1")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    from weights_accuracy import prompts

    import structkv
    from structkv import methods
    from structkv.runtime.compress import compress_shared
    from structkv.text.prompts import encode_batch

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    samples = prompts(model, args.length, args.per_task, args.chat)
    names = args.methods.split(",")
    settings = [None, *args.kv_dtypes.split(",")]
    sums = {(kv, n): {"kl": [], "top1": [], "bytes": []} for kv in settings for n in names}
    with torch.inference_mode():
        for s in samples:
            ids = s["input_ids"]
            context, scored = ids[:-args.positions], ids[-args.positions:]
            tokens, positions, _ = encode_batch(model, [context])
            reference = None
            for kv in settings:
                model.kv_dtype = kv
                runs = [methods.build(n, kv=args.kv_budget) for n in names]
                states = compress_shared(model, tokens, positions, runs, room=args.positions + 1)
                for n, state in zip(names, states):
                    logp = teacher_forced(model, state, scored)
                    if reference is None:  # the float full cache: the first row of the first setting
                        reference = logp
                    acc = sums[(kv, n)]
                    acc["kl"].append(float((reference.exp() * (reference - logp)).sum(-1).mean()))
                    acc["top1"].append(float((reference.argmax(-1) == logp.argmax(-1)).float().mean()))
                    acc["bytes"].append(sum(layer.entry_bytes() * layer.entries() for layer in state.cache.layers))
            model.kv_dtype = None
    rows = []
    for (kv, n), acc in sums.items():
        rows.append({"model": args.model, "kv_dtype": kv or "float32", "method": n, "kv_budget": args.kv_budget,
                     "prompts": len(samples), "positions": args.positions, "length": args.length,
                     "kl_mean": sum(acc["kl"]) / len(acc["kl"]), "kl_max": max(acc["kl"]),
                     "top1_agreement": sum(acc["top1"]) / len(acc["top1"]),
                     "kv_mib_kept": sum(acc["bytes"]) / len(acc["bytes"]) / 2**20})
        print(json.dumps(rows[-1]), flush=True)
    base = {r["method"]: r["kv_mib_kept"] for r in rows if r["kv_dtype"] == "float32"}
    print("\n| method | KV entries | KL to the float32 full cache (mean / worst prompt) | top-1 agreement | "
          "KV MiB kept (x fewer than float32, than bf16) |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = base[r["method"]] / r["kv_mib_kept"]
        print(f"| {r['method']} | {r['kv_dtype']} | {r['kl_mean']:.4f} / {r['kl_max']:.4f} | "
              f"{100 * r['top1_agreement']:.1f} % | {r['kv_mib_kept']:.2f} ({ratio:.2f}x, {ratio / 2:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
