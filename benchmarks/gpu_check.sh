#!/usr/bin/env bash
# GPU check in parts, each under 8 minutes on one H100/H200 (one device call each): the Llama-3.1-8B
# shape (random weights, bf16) prefilled and decoded by full, FastKV, StructKV and the paper's
# StructKV (dynamic pivot) through `structkv bench`; the Triton ops against their references;
# tensor parallelism where several GPUs are present. Needs only what a bare GPU image has (torch,
# triton, numpy, safetensors, tokenizers); the gloo equivalence check also needs transformers,
# pytest and hypothesis (it builds the tiny models with the tests' helper) and is skipped without.
# Run from the repository root:
#   PART=env bash benchmarks/gpu_check.sh                       # versions, the GPU (seconds)
#   PART=bench LENGTHS=32768 bash benchmarks/gpu_check.sh       # one length per call at 8B
#   PART=ops bash benchmarks/gpu_check.sh                       # Triton kernels vs references
#   PART=tp bash benchmarks/gpu_check.sh                        # TP=2/4/8 where the GPUs allow
#   PART=check bash benchmarks/gpu_check.sh                     # 2-rank gloo equivalence (CPU)
# PART=all runs them in order. DRY=1 runs every part on this machine's CPU at toy sizes (a small
# random model, 512-1024 tokens, TP=2 on gloo, the ops' imports and arguments only): it checks the
# script, its imports and its arguments, not the GPU. Results go to $OUT (default gpu_results).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PART=${PART:-all}
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then
    DEVICE=${DEVICE:-cpu} MODEL=${MODEL:-random:qwen2.5-0.5b} DTYPE=${DTYPE:-float32}
    LENGTHS=${LENGTHS:-512,1024} TP_LENGTHS=${TP_LENGTHS:-512} REPEATS=${REPEATS:-1} TP_DEGREES=${TP_DEGREES:-2}
fi
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
DTYPE=${DTYPE:-bfloat16}
LENGTHS=${LENGTHS:-32768}
REPEATS=${REPEATS:-2}
METHODS=${METHODS:-full,fastkv,structkv,structkv_paper}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
wants() { [ "$PART" = all ] || [[ ",$PART," == *",$1,"* ]]; }

if wants env; then
    python3 - <<'PY' | tee "$OUT/env.txt"
import importlib.util, sys
missing = [m for m in ("torch", "safetensors", "tokenizers", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing packages {missing}: install them (torch with CUDA) before running this script")
import torch
print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import structkv  # the package imports on this image
PY
    if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"; fi
fi

# prefill / decode / peak memory / overhead, side by side in one process
if wants bench; then
    python3 -m structkv.cli bench --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" \
        --methods "$METHODS" --lengths "$LENGTHS" --kv-budget 0.1 --struct-budget 0.2 \
        --repeats "$REPEATS" --warmup 1 --new-tokens 32 --no-hf --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
fi

# Triton kernels vs the aten references (timings, memory, max error); needs CUDA
if wants ops; then
    if [ "$DEVICE" = cuda ]; then
        python3 benchmarks/gpu_ops.py 2>&1 | tee "$OUT/ops.log"
    else
        python3 benchmarks/gpu_ops.py --help > /dev/null && echo "ops: imports and arguments checked (no CUDA)" \
            | tee "$OUT/ops.log"
    fi
fi

# tensor parallelism (torchrun): the same shape at TP = every degree in TP_DEGREES the GPUs allow
if wants tp; then
    NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
    TP_DEGREES=${TP_DEGREES:-2,4,8}
    TP_LENGTHS=${TP_LENGTHS:-32768}
    for tp in ${TP_DEGREES//,/ }; do
        if [ "$DEVICE" = cuda ] && [ "$tp" -gt "$NGPU" ]; then echo "TP=$tp skipped: $NGPU GPU(s)"; continue; fi
        python3 -m torch.distributed.run --nproc-per-node "$tp" -m structkv.cli bench --tp "$tp" --model "$MODEL" \
            --dtype "$DTYPE" --device "$DEVICE" --methods full,fastkv,structkv --lengths "$TP_LENGTHS" \
            --kv-budget 0.1 --struct-budget 0.2 --repeats "$REPEATS" --warmup 1 --new-tokens 32 --no-hf \
            --out "$OUT/tp$tp" 2>&1 | tee "$OUT/tp$tp.log"
    done
fi

# the 2-rank gloo equivalence check on tiny models (CPU)
if wants check; then
    if python3 -c "import transformers, pytest, hypothesis" 2>/dev/null; then
        python3 - "$OUT/tp_check_models" <<'PY'
import sys
sys.path.insert(0, "tests")
from conftest import make_hf_model
for arch in ("llama", "qwen2", "qwen3", "gemma3_text"):
    make_hf_model(arch).save_pretrained(f"{sys.argv[1]}/{arch}")
PY
        python3 -m structkv.harness.tp_check "$OUT"/tp_check_models/* --compile 2>&1 | tee "$OUT/tp_check.log"
    else
        echo "gloo check skipped: it needs transformers, pytest and hypothesis (the tests' model helper)" \
            | tee "$OUT/tp_check.log"
    fi
fi
echo "done: $OUT ($PART)"
