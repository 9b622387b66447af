"""structkv.hf's prefill on a real transformers model: what token pruning between layers saves.

The same prompt (random token ids from the model's vocabulary, `--length` tokens) compressed by
each method through `structkv.hf.compress`, median of `--repeats` after one warm-up, on the
transformers model loaded from the GGUF structkv loads (SmolLM2 by default):

    python research/experiments/hf_prefill.py --model smollm2 --length 2048 --methods full,snapkv,fastkv,structkv

Prints one row per method: prefill seconds, the share of token-layers computed, and the ratio to
full's prefill time measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from kvpress_peer import gguf_of  # the GGUF structkv loads for a model name  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--methods", default="full,snapkv,fastkv,structkv")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    import structkv.hf as hf
    from structkv import methods

    gguf = gguf_of(args.model)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.randint(10, model.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.methods.split(","):
        method = methods.get(name)
        hf.compress(model, None, ids.tolist(), method)  # warm-up
        runs = [hf.compress(model, None, ids.tolist(), method).stats for _ in range(args.repeats)]
        rows.append((name, statistics.median(r["prefill_s"] for r in runs), runs[0]["prefill_fraction"]))
    base = dict((n, s) for n, s, _ in rows).get("full")
    title = f"prefill s ({args.length} tokens, {args.model}, transformers)"
    print(f"| method | {title} | token-layers computed | vs full |")
    print("|---|---|---|---|")
    for name, s, frac in rows:
        print(f"| {name} | {s:.3f} | {frac:.3f} | {s / base:.3f} |" if base else f"| {name} | {s:.3f} | {frac:.3f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
