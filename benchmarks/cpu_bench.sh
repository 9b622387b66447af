#!/usr/bin/env bash
# The CPU figures of research/benchmarks_log.md ("structkv bench" section), in one script (~50 min on 2 cores).
# Results land in research/results/bench/<run>/ (bench.json, bench.md, latency_vs_length.png).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-research/results/bench}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}

# Targets at 8K (and Gemma at 4K too, to pair with the 4K RULER run in the Pareto plot): Qwen2.5-0.5B shape (random weights; pivot fixed at mid-depth, since random weights
# have no structure for the detector to find) and Gemma 3 270M (real weights, dynamic pivot).
$PY -m structkv.cli bench --model random:qwen2.5-0.5b --methods full,snapkv,fastkv,structkv --lengths 8192 \
    --pivot 0.5 --repeats 2 --warmup 1 --new-tokens 32 --out "$OUT/qwen05b_8k"
$PY -m structkv.cli bench --model gemma-3-270m --methods full,streaming_llm,snapkv,pyramidkv,h2o,gemfilter,fastkv,structkv \
    --lengths 4096,8192 --repeats 2 --warmup 1 --new-tokens 32 --eval research/results/ruler_4k --out "$OUT/gemma"
# Scaling: 1K..16K on the 0.5B shape, 2K..32K on Gemma 3 270M (32752 + 8 new tokens = its 32768 positions).
$PY -m structkv.cli bench --model random:qwen2.5-0.5b --methods full,structkv --lengths 1024,2048,4096,8192,16384 \
    --pivot 0.5 --repeats 1 --warmup 1 --new-tokens 8 --no-hf --out "$OUT/qwen05b_scaling"
$PY -m structkv.cli bench --model gemma-3-270m --methods full,structkv --lengths 2048,8192,32752 \
    --repeats 1 --warmup 1 --new-tokens 8 --no-hf --out "$OUT/gemma_scaling"
