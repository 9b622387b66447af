"""How often serve's compiled batched step recompiles as rows join and leave (issue 49's "no
recompiles" point, measured rather than assumed).

Rows of different prompt lengths join a `structkv.serve.batcher.Batch` every few steps and leave
when their tokens are done (1 -> 2 -> 3 -> 2 -> 1 rows), with the decode step compiled as serve's
`--compile always` does (`static`: one graph per shape, dynamo's default after the first) and
with `dynamic=True`. Prints the graphs each compiled and the seconds the recompiling steps took.

    python benchmarks/batch_recompiles.py --model smollm2
"""
from __future__ import annotations

import argparse
import statistics
import time


def run(model, mode: str, plan) -> dict:
    from torch._dynamo.utils import counters

    from structkv.runtime import decoding
    from structkv.runtime.generation import start
    from structkv.serve.batcher import Batch, Row
    from structkv.util.compiling import compiled_per_model

    batch = Batch(model, compile="inductor")
    if mode == "dynamic":
        batch.step_fn = compiled_per_model(decoding.decode_step, "inductor", fullgraph=True, dynamic=True)
    before, pending, steps, compiling, plain = counters["stats"]["unique_graphs"], list(plan), 0, [], []
    while pending or len(batch):
        if pending and steps % 4 == 0:
            n, new = pending.pop(0)
            batch.join(Row(start(model, list(range(10, 10 + n)), max_new_tokens=new), new))
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        batch.step()
        steps += 1
        (compiling if counters["stats"]["unique_graphs"] > graphs else plain).append(
            (len(batch), time.perf_counter() - t0))
    return {"mode": mode, "graphs": counters["stats"]["unique_graphs"] - before, "steps": steps,
            "compile_s": [round(t, 1) for _, t in compiling], "step_ms": 1e3 * statistics.median(t for _, t in plain)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    import structkv

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    plan = [(40, 12), (100, 12), (300, 12)]  # (prompt tokens, new tokens): 1 -> 2 -> 3 -> 2 -> 1 rows
    print("| step compiled | graphs | steps | seconds of the recompiling steps | other steps, median ms |")
    print("|---|---|---|---|---|")
    for mode in ("static", "dynamic"):
        r = run(model, mode, plan)
        print(f"| {mode} | {r['graphs']} | {r['steps']} | {', '.join(map(str, r['compile_s']))} | {r['step_ms']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
