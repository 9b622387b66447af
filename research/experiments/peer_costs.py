"""Prefill seconds, peak memory and kept bytes of the peer folders, over the prompts every label has.

The cost half of the side by side (the accuracy half is `common_subset.py`): per label of the
folders written by `hf_peer.py` (structkv.hf) and `kvpress_peer.py` (kvpress's presses), the mean
prefill seconds, the mean and largest peak resident memory an answer added above the loaded model
(`kvpress_peer.PeakRSS`) and the K+V MiB kept, over the prompts every label has.

    python research/experiments/peer_costs.py research/results/ruler_2k_question_after_smollm2_hf_mem \\
        research/results/ruler_2k_question_after_smollm2_kvpress_mem
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    a = ap.parse_args(argv)
    by: dict = {}
    for folder in a.folders:
        for line in (folder / "predictions.jsonl").read_text().splitlines():
            r = json.loads(line)
            by.setdefault(r["label"], {})[(r["task"], r["index"])] = r
    common = set.intersection(*(set(v) for v in by.values()))
    print(f"Over the {len(common)} prompts every one of {len(by)} labels has.\n")
    print("| label | score | prefill s | peak MiB above the model (mean / max) | K+V MiB kept |\n|---|---|---|---|---|")
    for label in sorted(by):
        rows = [by[label][p] for p in common]
        peaks = [r["peak_rss_mib"] for r in rows]
        print(f"| {label} | {100 * statistics.fmean(r['score'] for r in rows):.1f} | "
              f"{statistics.fmean(r['prefill_s'] for r in rows):.2f} | "
              f"{statistics.fmean(peaks):.0f} / {max(peaks):.0f} | "
              f"{statistics.fmean(r['kv_bytes_kept'] for r in rows) / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
