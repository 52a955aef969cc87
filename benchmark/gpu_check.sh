#!/usr/bin/env bash
# One prepared GPU session (the lent H200): kernel tests on CUDA, then the kernel benchmark.
# Needs a venv with CUDA torch + triton 3.8.0 (e.g. `make venv TORCH_SPEC=torch==2.14.1`).
# Output lands in $OUT (or benchmark/results) so it survives the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmark/results}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 240 "$PY" -m pytest -q tests/kernels -m gpu -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
timeout 300 "$PY" benchmark/kernel_kda.py --T 4096,32768,131072 --out "$OUT/kernel_kda.csv" 2>&1 \
  | tee "$OUT/kernel_kda.txt"
