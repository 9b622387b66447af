"""window_scores on CPU: the chunked reference vs the materialised definition, time and peak memory.

Each (implementation, N) runs in its own subprocess so peak RSS is clean; the extra peak is the
high-water mark during the call minus the one after the inputs were allocated.

    python benchmarks/ops_memory.py [--lengths 8192,32768,65536] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

W, HQ, HKV, D = 32, 32, 8, 128


def child(impl: str, n: int, repeats: int) -> None:
    import torch

    from structkv.ops import window_scores_naive, window_scores_reference

    torch.manual_seed(0)
    q = torch.randn(1, HQ, W, D)
    k = torch.randn(1, HKV, n, D)
    k_pos = torch.arange(n)[None]
    q_pos = k_pos[:, -W:].clone()
    fn = window_scores_reference if impl == "reference" else window_scores_naive
    fn(q[:, :, :2], k[:, :, :64], q_pos[:, :2], k_pos[:, :64], D**-0.5)  # one-time library set-up, not the op
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        fn(q, k, q_pos, k_pos, D**-0.5)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"impl": impl, "n": n, "median_s": statistics.median(times[1:]),
                      "extra_peak_mib": (peak - before) / 1024}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.repeats)
    rows = {}
    for n in [int(x) for x in args.lengths.split(",")]:
        for impl in ("reference", "naive"):
            out = subprocess.run([sys.executable, __file__, "--child", impl, str(n), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True).stdout
            rows[impl, n] = json.loads(out.strip().splitlines()[-1])
            print(rows[impl, n], flush=True)
    import torch

    print(f"\nwindow_scores, CPU, w={W}, Hq={HQ}, Hkv={HKV}, D={D}, fp32, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} after 1 warm-up\n")
    print("| N | reference (s) | naive (s) | naive / reference time | reference extra peak (MiB) "
          "| naive extra peak (MiB) | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in sorted({n for _, n in rows}):
        r, m = rows["reference", n], rows["naive", n]
        print(f"| {n} | {r['median_s']:.3f} | {m['median_s']:.3f} | {m['median_s'] / r['median_s']:.2f}x "
              f"| {r['extra_peak_mib']:.0f} | {m['extra_peak_mib']:.0f} "
              f"| {m['extra_peak_mib'] / max(r['extra_peak_mib'], 1):.1f}x |")


if __name__ == "__main__":
    main()
