"""How often serve's compiled batched step recompiles as rows join and leave (issue 49's "no
recompiles" point, measured rather than assumed).

Rows of different prompt lengths join a `structkv.serve.batcher.Batch` every few steps and leave
when their tokens are done (1 -> 2 -> 3 -> 3 -> 3 -> 2 -> 1 rows, the cache's capacity changing at
every join), with the decode step compiled three ways: `per shape` (a static graph per row count
and capacity, serve's step before), `dynamic=True` (torch.compile's own), and `symbolic rows and
capacity` (serve's step now: `structkv.runtime.decoding.compiled_batch_decode`), beside the eager
step. Prints the graphs each compiled, the seconds the recompiling steps took and the median of
the other steps, and the median step of three rows decoding together with nothing joining.

    python research/experiments/batch_recompiles.py --model smollm2
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def run(model, mode: str, plan) -> dict:
    from torch._dynamo.utils import counters

    from structkv.runtime import decoding
    from structkv.serve.batcher import Batch
    from structkv.util.compiling import compiled_per_model

    batch = Batch(model, compile="inductor")  # symbolic rows and capacity
    if mode == "eager":
        batch.step_fn = decoding.decode_step
    elif mode == "per shape":
        batch.step_fn = decoding.compiled_decode("inductor")
    elif mode == "dynamic=True":
        batch.step_fn = compiled_per_model(decoding.decode_step, "inductor", fullgraph=True, dynamic=True)
    before, pending, steps, compiling, plain = counters["stats"]["unique_graphs"], list(plan), 0, [], []
    while pending or len(batch):
        if pending and steps % 4 == 0:
            n, new = pending.pop(0)
            join(model, batch, n, new)
        graphs, t0, rows = counters["stats"]["unique_graphs"], time.perf_counter(), len(batch)
        batch.step()
        steps += 1
        (compiling if counters["stats"]["unique_graphs"] > graphs else plain).append(
            (rows, time.perf_counter() - t0))
    graphs = counters["stats"]["unique_graphs"] - before  # those the joins and leaves compiled
    return {"mode": mode, "graphs": graphs, "steps": steps, "steady_ms": steady_step(model, batch),
            "compile_s": [f"{t:.1f} ({r} rows)" for r, t in compiling],
            "step_ms": 1e3 * statistics.median(t for _, t in plain)}


def join(model, batch, prompt_tokens: int, new_tokens: int) -> None:
    """A row of `prompt_tokens` made-up tokens, prefilled and joining `batch` for `new_tokens`."""
    from structkv.runtime.generation import start
    from structkv.serve.batcher import Row

    batch.join(Row(start(model, list(range(10, 10 + prompt_tokens)), max_new_tokens=new_tokens), new_tokens))


def steady_step(model, batch, rows: int = 3, warm: int = 5, timed: int = 20) -> float:
    """Median ms of a step once `rows` rows run together and nothing joins or leaves (the graphs a
    steady batch runs; a per-shape step compiles its new shape in the warm steps)."""
    batch.eos = set()
    for n in (40, 100, 300)[:rows]:
        join(model, batch, n, warm + timed + 1)
    times = []
    for _ in range(warm + timed):
        t0 = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[warm:])


MODES = ("eager", "per shape", "dynamic=True", "symbolic rows and capacity")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=MODES, help="one mode in this process (default: each in a process of its "
                   "own, so no mode finds another's graphs in dynamo's cache)")
    args = p.parse_args()
    if args.mode is None:
        print("| step compiled | graphs | steps | seconds of the recompiling steps (rows) | other steps, median ms | "
              "3 rows steady, median ms |")
        print("|---|---|---|---|---|---|", flush=True)
        for mode in MODES:
            subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                            "--mode", mode], check=True)
        return
    import torch

    import structkv

    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    plan = [(40, 12), (100, 12), (300, 12), (60, 12), (200, 12)]  # (prompt tokens, new tokens), one every 4 steps
    r = run(model, args.mode, plan)
    print(f"| {args.mode} | {r['graphs']} | {r['steps']} | {', '.join(r['compile_s'])} | {r['step_ms']:.1f} | "
          f"{r['steady_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
