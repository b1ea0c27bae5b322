#!/usr/bin/env bash
# One device call: GPU tests, then a benchmark; everything lands under $OUT.
#   bash experiments/gpu_check.sh [tests|quick|tuner]
set -uo pipefail
OUT=${OUT:-/tmp/concur_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${1:-}" = "tuner" ]; then  # issue 4: sweep vs tuner, NVML phases, traces, HTML report
  timeout 570 python3 experiments/gpu_tuner_report.py --out "$OUT" 2>&1 | tee "$OUT/gpu_tuner_report.log" | tail -40
  exit 0
fi
timeout 540 python3 -m pytest -m cuda -q -s --no-header -p no:cacheprovider tests/test_gpu.py tests/test_gpu_tuner.py \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^W1\|Warning" | tail -30
if [ "${1:-}" != "tests" ]; then
  args="--repeats 20 --streams 2 4 8"
  [ "${1:-}" = "quick" ] && args="--models googlenet inception_v3 --batches 8 64 --repeats 20"
  python3 experiments/bench_train.py $args --out "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" | tail -30
fi
