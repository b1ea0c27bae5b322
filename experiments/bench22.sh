#!/usr/bin/env bash
# Issue 22's benchmark on the device, in one call: several sweeps side by side over one run directory,
# so they compile in parallel and share one GPU lock (each timing alone, pairs timed in turns).
#   bash experiments/bench22.sh RUN_DIR PART    (PART: a to k; see below). Packs RUN_DIR to $OUT/bench.tgz.
set -uo pipefail
dir=$1; part=$2; OUT=${OUT:-/tmp/concur_out}; mkdir -p "$OUT" "$dir"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
left=$(( ${DEADLINE:-570} - SECONDS - 20 ))
sweep() { timeout -k 5 $left python3 -m experiments.sweep --out "$dir" --resume --precisions bf16 --repeats 30 \
            --rounds 5 "$@" >> "$OUT/bench_$part.log" 2>&1 & }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
case $part in
  a) sweep --models resnet50 --batches 8 32 64 --modes compile_graph fused:4 fused_nosplit:4 \
           --together compile_graph+fused:4+fused_nosplit:4 --compile-jobs 3
     sweep --models inception_v3 --batches 8 32 64 --modes compile_graph fused:4 --together compile_graph+fused:4 \
           --compile-jobs 3
     sweep --models torchvision:vit_b_16 --batches 32 64 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models timm:dla34 timm:hrnet_w18_small --batches 8 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2 ;;
  b) sweep --models googlenet --batches 8 64 --modes compile_graph fused:4 fused_nosplit:4 \
           --together compile_graph+fused:4+fused_nosplit:4 --compile-jobs 2
     sweep --models timm:dla34 timm:hrnet_w18_small --batches 64 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models timm:inception_v4 --batches 8 --modes compile_graph fused:4 --together compile_graph+fused:4 \
           --compile-jobs 1 ;;
  c) sweep --models timm:inception_v4 --batches 8 --modes compile_graph fused:4 --together compile_graph+fused:4 \
           --compile-jobs 2
     sweep --models torchvision:vit_b_16 --batches 64 32 --modes compile_graph fused:4 fused_gate105:4 \
           --together compile_graph+fused:4+fused_gate105:4 --compile-jobs 3
     sweep --models googlenet inception_v3 resnet50 --batches 8 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2 ;;
  d) sweep --models resnet50 --batches 8 64 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models googlenet inception_v3 --batches 64 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models timm:inception_v4 --batches 64 --modes compile_graph fused:4 --together compile_graph+fused:4 \
           --compile-jobs 2 ;;
  e) sweep --models googlenet inception_v3 --batches 8 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 3
     sweep --models torchvision:vit_b_16 resnet50 --batches 32 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 3
     sweep --models googlenet inception_v3 resnet50 --batches 8 64 --modes serial_graph concur_graph:4 \
           concur_graph_nosplit:4 critical_path --together serial_graph+concur_graph:4+concur_graph_nosplit:4 ;;
  g) for m in ${MODELS:-googlenet inception_v3 resnet50}; do  # three side by side fill the 80 GB at b128: two at a time
       sweep --models $m --batches 32 128 --precisions fp32 --modes compile_graph fused:4 \
             --together compile_graph+fused:4 --compile-jobs 2
     done ;;
  h) sweep --models torchvision:vit_b_16 --batches 32 64 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models timm:dla34 timm:hrnet_w18_small --batches 8 64 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 2
     sweep --models timm:inception_v4 --batches 8 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 1 ;;
  i) sweep --models googlenet inception_v3 --batches 8 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 2
     sweep --models torchvision:vit_b_16 resnet50 --batches 32 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 2 ;;
  j) sweep --models torchvision:vit_b_16 --batches 64 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 1
     sweep --models googlenet inception_v3 --batches 64 --modes compile_graph fused:4 fused_ordered:4 \
           --together compile_graph+fused:4+fused_ordered:4 --compile-jobs 2 ;;
  k) sweep --models timm:inception_v4 --batches 64 --precisions fp32 --modes compile_graph fused:4 \
           --together compile_graph+fused:4 --compile-jobs 1 ;;
esac
wait
pkill -f "experiments.sweep --(one|group)"
grep -h ": ok\|error\|failed" "$OUT/bench_$part.log" | tail -40
tar czf "$OUT/bench.tgz" --exclude=traces --exclude=util "$dir"
