#!/usr/bin/env bash
# The kernel pack against flash-linear-attention's Triton kernels, on a lent GPU (never in CI; under 10 minutes).
# Needs torch with CUDA and flash-linear-attention installed (pip install flash-linear-attention).
#   bash bench/gpu_kernels.sh [OUT_DIR]
set -euo pipefail
out=${1:-bench/results/gpu}
mkdir -p "$out"
for dtype in float32 bfloat16; do
  timeout 280 python -m conformance kernels --engine bench.fla_kernels:FlaKernels --cases '^gdr-(chunked|recurrent)' \
    --dtype "$dtype" 2>&1 | tee "$out/fla_kernels_$dtype.txt" || true
done
