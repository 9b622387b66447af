#!/usr/bin/env bash
# GPU check of the Triton ops (under 5 minutes on one H200). Run from the repository root on a
# CUDA machine: installs structkv into a throwaway venv (torch from the machine if present).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, triton" 2>/dev/null || python3 -m pip install -q torch triton
python3 -m pip install -q --no-deps -e . 2>/dev/null || true
python3 -m pip install -q einops safetensors huggingface-hub tokenizers numpy 2>/dev/null || true
PYTHONPATH=. python3 benchmarks/gpu_ops.py "$@"
