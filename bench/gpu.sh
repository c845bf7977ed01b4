#!/usr/bin/env bash
# The GPU figures in the README, from one prepared run on a GPU machine:
#   bench/gpu.sh OUT_DIR [bench]          jax_speed in bf16: jax_impl and transformers on the GPU, reference on the CPU
#   bench/gpu.sh OUT_DIR conformance      the jax_bf16 and jax (fp32, full-precision matmuls) engines on the GPU
# Every step is time-limited and logged to OUT_DIR, so a failing step still leaves the others' figures.
set -u
out=${1:?usage: bench/gpu.sh OUT_DIR [bench|conformance]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__,
'| transformers', transformers.__version__)" 2>&1 | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$out/versions.txt"
case ${2:-bench} in
  bench)
    timeout 420 python3 -m bench.jax_speed --dtype bfloat16 --engines reference jax transformers 2>&1 \
      | tee "$out/jax_speed_bf16.txt" ;;
  conformance)
    timeout 200 python3 -m conformance run --engine jax_bf16 --report "$out/conformance_jax_bf16.json" 2>&1 \
      | tail -n 15 | tee "$out/conformance_jax_bf16.txt"
    # XLA rounds fp32 matmuls to TF32 on a GPU unless told otherwise; the fp32 goldens' bounds assume fp32
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m conformance run --engine jax \
      --report "$out/conformance_jax.json" 2>&1 | tail -n 15 | tee "$out/conformance_jax.txt" ;;
esac
