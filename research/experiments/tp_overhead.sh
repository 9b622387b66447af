#!/usr/bin/env bash
# Tensor parallelism on this CPU: one process (2 threads) against TP=2 (2 gloo ranks, 1 thread each),
# same model shape, lengths and methods, one after the other in one call; prints prefill and decode
# ratios and the KV bytes per rank. On CPU TP cannot pay (both set-ups share the same 2 cores and
# TP adds an all-reduce per layer), so this measures the overhead of the collectives, not a speed-up.
#   OUT=tp_overhead bash research/experiments/tp_overhead.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-tp_overhead}
MODEL=${MODEL:-random:qwen2.5-0.5b}
LENGTHS=${LENGTHS:-1024}
METHODS=${METHODS:-full,structkv}
PY=${PY:-python3}
common=(--model "$MODEL" --no-hf --lengths "$LENGTHS" --methods "$METHODS" --repeats 3 --warmup 1 --new-tokens 16)
$PY -m structkv.cli bench "${common[@]}" --threads 2 --out "$OUT/tp1" > "$OUT.tp1.log" 2>&1 || { cat "$OUT.tp1.log"; exit 1; }
$PY -m torch.distributed.run --nproc-per-node 2 -m structkv.cli bench --tp 2 "${common[@]}" --threads 1 \
    --out "$OUT/tp2" > "$OUT.tp2.log" 2>&1 || { cat "$OUT.tp2.log"; exit 1; }
$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
one, two = (json.load(open(f"{out}/{d}/bench.json"))["rows"] for d in ("tp1", "tp2"))
rank1 = json.load(open(f"{out}/tp2/rank1/bench.json"))["rows"]
print("| tokens | method | prefill s TP=1 | prefill s TP=2 | TP=2 / TP=1 | decode tok/s TP=1 | TP=2 | TP=1 / TP=2 "
      "| KV MiB TP=1 | KV MiB per rank TP=2 (rank 0, 1) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for a, b, c in zip(one, two, rank1):
    pa, pb = a["prefill_s"]["median"], b["prefill_s"]["median"]
    da, db = a["decode_tokens_per_s"]["median"], b["decode_tokens_per_s"]["median"]
    print(f"| {a['tokens']} | {a['method']} | {pa:.3f} | {pb:.3f} | {pb / pa:.2f}x | {da:.1f} | {db:.1f} | "
          f"{da / db:.2f}x | {a['kv_bytes'] / 2**20:.2f} | {b['kv_bytes'] / 2**20:.2f}, {c['kv_bytes'] / 2**20:.2f} |")
PY
