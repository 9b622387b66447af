"""One decode step's few-row quantized products, timed alone: every quantized linear of a model
(the LM head included) applied to one row of x, in the model's order, `--rounds` passes; the
median ms a pass and the GB/s of the weights it reads.

Why: the products are the largest part of a small model's decode step on CPU, and a change to
their per-call cost (quantizing x, allocation, thread split) is too small for whole-step pairs to
settle on a shared machine. Run it under two checkouts alternately (PYTHONPATH picks the tree) to
compare revisions side by side:

    for r in 1 2 3 4 5 6; do for t in /path/to/before .; do echo "$t $(PYTHONPATH=$t python \
        research/experiments/products_step.py --model smollm2 --weights int4 --threads 2 --quiet)"; done; done
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quiet", action="store_true", help="print the median ms only")
    args = ap.parse_args(argv)
    import torch

    import structkv
    from structkv.models.quantized import QuantizedLinear

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model, weights=args.weights)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    rows = [torch.randn(1, m.in_features) for m in linears]
    weight_bytes = sum(sum(t.numel() * t.element_size() for t in m.buffers()) for m in linears)
    passes = []
    with torch.inference_mode():
        for _ in range(args.rounds):
            start = time.perf_counter()
            for m, x in zip(linears, rows):
                m._product(x)  # the op itself, as the compiled step calls it (no module call around it)
            passes.append(time.perf_counter() - start)
    ms = statistics.median(passes) * 1e3
    if args.quiet:
        print(f"{ms:.3f}")
    else:
        print(f"{args.model} {args.weights}: {len(linears)} products, {weight_bytes / 1e6:.1f} MB, "
              f"{args.threads} threads: {ms:.2f} ms a pass (median of {args.rounds}), "
              f"{weight_bytes / ms / 1e6:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
