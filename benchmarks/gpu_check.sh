#!/usr/bin/env bash
# GPU check, one call (about 8-9 minutes on one H200): Llama-3.1-8B shape (random weights, bf16),
# prefill at 8K/32K/64K and decode for full, FastKV and StructKV via `structkv bench`, the Triton
# ops against their references, then tensor parallelism (TP=2/4/8 where the GPUs allow; the gloo
# equivalence check always). Run from the repository root on a CUDA machine:
#   OUT=gpu_results bash benchmarks/gpu_check.sh
# Dry run of the same path on CPU (small model and lengths, TP=2 on gloo; checks the script, not the GPU):
#   DEVICE=cpu MODEL=random:qwen2.5-0.5b DTYPE=float32 LENGTHS=512,1024 TP_LENGTHS=512 REPEATS=1 OPS=0 \
#       bash benchmarks/gpu_check.sh
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
# 3. tensor parallelism (torchrun): the same shape at TP = every degree in TP_DEGREES that fits the
#    GPUs here (8 KV heads: 2, 4, 8), full / FastKV / StructKV at TP_LENGTHS: prefill, decode tok/s
#    and KV bytes per rank (rank r's figures in tp<N>/rank<r>/); then the 2-rank gloo equivalence check
#    on tiny models (needs transformers to build them). One GPU: TP=1 is section 1, plus the check.
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$DEVICE" = cpu ]; then TP_DEGREES=${TP_DEGREES:-2}; else TP_DEGREES=${TP_DEGREES:-2,4,8}; fi
TP_LENGTHS=${TP_LENGTHS:-32768}
for tp in ${TP_DEGREES//,/ }; do
    if [ "$DEVICE" = cuda ] && [ "$tp" -gt "$NGPU" ]; then echo "TP=$tp skipped: $NGPU GPU(s)"; continue; fi
    python3 -m torch.distributed.run --nproc-per-node "$tp" -m structkv.cli bench --tp "$tp" --model "$MODEL" \
        --dtype "$DTYPE" --device "$DEVICE" --methods full,fastkv,structkv --lengths "$TP_LENGTHS" --kv-budget 0.1 \
        --struct-budget 0.2 --repeats "$REPEATS" --warmup 1 --new-tokens 32 --no-hf --out "$OUT/tp$tp" \
        2>&1 | tee "$OUT/tp$tp.log"
done
if python3 -c "import transformers" 2>/dev/null; then
    python3 - "$OUT/tp_check_models" <<'PY'
import sys
sys.path.insert(0, "tests")
from conftest import make_hf_model
for arch in ("llama", "qwen2", "qwen3", "gemma3_text"):
    make_hf_model(arch).save_pretrained(f"{sys.argv[1]}/{arch}")
PY
    python3 -m structkv.harness.tp_check "$OUT"/tp_check_models/* --compile 2>&1 | tee "$OUT/tp_check.log"
else
    echo "gloo check skipped: transformers is not installed (it builds the tiny models)" | tee "$OUT/tp_check.log"
fi
echo "done: $OUT"
