#!/usr/bin/env bash
# Issue 18's GPU table, one prepared run of at most 10 minutes on a machine with one GPU (never part of CI):
#   bench/gpu_serving.sh OUT_DIR
# bench/serving_speed.py in bf16 (DeltaNet state fp32) on random weights shaped like Qwen3.5-0.8B and Qwen3.5-9B,
# made on the device (no checkpoint written): tokens/s at B = 1 to 256, plain decoding beside n-gram and MTP
# speculative decoding (K = 4), the step time at B = 1 against the HBM roofline (weight bytes / XLA's measured GEMV
# bandwidth), and the step time by B (a step whose time does not grow with B is bound by kernel launches and the
# while loop's host round trip, not by the weights). Every step is time-limited and logged, so a failing one still
# leaves the others' figures. Budget: 9B loads in ~1 min (18 GB of bf16 made on the device) and compiles 2 step
# programs per (drafter, B); the 9B part runs fewer figures to fit.
set -u
out=${1:?usage: bench/gpu_serving.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$out/versions.txt"
timeout 300 python3 -m bench.serving_speed --models 0.8B --dtype bfloat16 --batches 1 4 16 64 256 \
  --new-tokens 64 --repeats 1 --steps-per-sync 64 --json "$out/serving_0.8b.json" 2>&1 | tee "$out/serving_0.8b.txt"
timeout 270 python3 -m bench.serving_speed --models 9B --dtype bfloat16 --batches 1 16 256 --drafts none ngram \
  --new-tokens 32 --repeats 1 --steps-per-sync 64 --json "$out/serving_9b.json" 2>&1 | tee "$out/serving_9b.txt"
