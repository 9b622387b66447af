"""Decode speed under a competing CPU load, per thread policy, side by side in one run.

Each variant (threads x OpenMP wait policy) decodes in a fresh process (the policy is read when
OpenMP starts), first on a quiet machine, then while `--load` other processes run 2-thread
matmul loops (the issue's reproduction: 8 threads on 2 cores, a fair share of 25 %). The
default OpenMP policy spins while waiting for work, which a busy machine punishes; PASSIVE sleeps.

    python research/experiments/thread_policy.py --model gemma-3-270m --load 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DECODE = """
import json, sys, time, torch, structkv
torch.set_num_threads({threads})
model = structkv.load({model!r})
ids = list(range(1000, 1000 + {prompt}))
structkv.generate(model, ids, max_new_tokens=4, compile=False, stop_at_eos=False)  # warm-up
rates = []
for _ in range({repeats}):
    out = structkv.generate(model, ids, max_new_tokens={tokens}, compile=False, stop_at_eos=False)
    rates.append(out.stats["decode_tokens_per_s"])
print(json.dumps(rates))
"""

LOAD = """
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


def run_variant(args, threads: int, policy: str | None) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    code = DECODE.format(threads=threads, model=args.model, prompt=args.prompt, tokens=args.tokens,
                         repeats=args.repeats)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--load", type=int, default=3, help="competing 2-thread processes")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    variants = [(2, None), (2, "PASSIVE"), (1, None), (1, "PASSIVE")]
    rows = {}
    for loaded in (False, True):
        load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(args.load if loaded else 0)]
        try:
            time.sleep(2 if loaded else 0)
            for threads, policy in variants:
                rows[(threads, policy, loaded)] = run_variant(args, threads, policy)
                print(json.dumps({"threads": threads, "omp_wait_policy": policy or "default", "load": loaded,
                                  "decode_tokens_per_s": rows[(threads, policy, loaded)]}), flush=True)
        finally:
            for p in load:
                p.kill()
    print(f"\n| threads, OMP_WAIT_POLICY | quiet: decode tokens/s (median) | with {args.load} competing 2-thread "
          "processes | share kept |")
    print("|---|---|---|---|")
    for threads, policy in variants:
        quiet = sorted(rows[(threads, policy, False)])[len(rows[(threads, policy, False)]) // 2]
        busy = sorted(rows[(threads, policy, True)])[len(rows[(threads, policy, True)]) // 2]
        print(f"| {threads}, {policy or 'default'} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
