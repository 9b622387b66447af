#!/usr/bin/env bash
# GPU check, one call (about 6-7 minutes on one H200): Llama-3.1-8B shape (random weights, bf16),
# prefill at 8K/32K/64K and decode for full, FastKV and StructKV via `structkv bench`, then the
# Triton ops against their references. Run from the repository root on a CUDA machine:
#   OUT=gpu_results bash benchmarks/gpu_check.sh
# Dry run of the same path on CPU (small model and lengths; checks the script, not the GPU):
#   DEVICE=cpu MODEL=random:qwen2.5-0.5b DTYPE=float32 LENGTHS=512,1024 REPEATS=1 OPS=0 bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
DTYPE=${DTYPE:-bfloat16}
LENGTHS=${LENGTHS:-8192,32768,65536}
REPEATS=${REPEATS:-3}
OPS=${OPS:-1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
python3 - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "einops", "safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing packages {missing}: pip install them (torch with CUDA) before running this script")
import torch
print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"; fi

# 1. prefill / decode / memory / overhead, side by side in one process
python3 -m structkv.cli bench --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" \
    --methods full,fastkv,structkv --lengths "$LENGTHS" --kv-budget 0.1 --struct-budget 0.2 \
    --repeats "$REPEATS" --warmup 1 --new-tokens 32 --no-hf --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"

# 2. Triton kernels vs the aten references (timings, memory, max error)
if [ "$OPS" = 1 ]; then
    python3 benchmarks/gpu_ops.py 2>&1 | tee "$OUT/ops.log"
fi
echo "done: $OUT"
