#!/usr/bin/env bash
# Speed and memory against PyTorch's recipes on the device: concur's defaults against the recipes written
# without concur in experiments/peers.py (the sweep's peer_* modes), each set timed in turns in one child, with
# the memory peaks (setup and steady, allocated and reserved) beside the times. Several sweeps run side by side
# over one run directory, compiling in parallel and taking turns to time (one GPU lock).
#   bash experiments/recipes.sh RUN_DIR PART [PART ...]   (PART: a to j, below; each within ~9 minutes on one H100)
# Logs go to $OUT (default RUN_DIR-out); RUN_DIR is packed to $OUT/bench.tgz and RUN_DIR/summary.md holds the table
# against the recipe. Parts that hold too much memory side by side are refused together (below).
#   a  bf16  googlenet inception_v3 resnet50, b8 b64: peer_compile_graph, compile_graph, fused:4
#   b  bf16  the same points unfused: peer_eager_graph, serial_graph, concur_graph:4
#   c  fp32  part a
#   d  bf16  timm hrnet_w18_small, dla34, inception_v4 at b8: part a's modes. Inception-v4's compile_graph
#            runs in a child of its own (three of its compiles in one child take over 9 minutes), so its
#            ratio to the recipe is not timed in turns; fused:4 and the recipe are
#   e  bf16  torchvision:vit_b_16 b32 b64, and the three CNNs of part a at b32: part a's modes
#   f  bf16  the three CNNs at b128: part a's modes
#   g  bf16  part d's networks at b64, Inception-v4 as in part d
#   h  fp32  the three CNNs at b32 (part c has b8 and b64): part a's modes
#   i  fp32  the three CNNs at b128, on their own as part f
#   j  bf16  timm hrnet_w18_small and dla34 at b8 unfused: part b's modes
# Every --together set names the recipe first: it compiles cold, as a user's first run would; the concur
# modes after it reuse its caches (their rows say so), so the summary gives no setup ratio for them.
set -uo pipefail
dir=$1; shift; parts=("$@"); OUT=${OUT:-$dir-out}
[ ${#parts[@]} -gt 0 ] || { echo "name a part: a to j" >&2; exit 2; }
for part in "${parts[@]}"; do  # every part known before any starts: the case below has one branch each
  [[ $part =~ ^[a-j]$ ]] || { echo "unknown part '$part': a to j" >&2; exit 2; }
done
# Pairs whose sweeps do not fit in one H100's 80 GB side by side: a and c hold twelve compile workers, each child
# holding its models; e and f, f and i hold b128 or ViT activations.
for pair in "a c" "e f" "f i"; do
  read -r x y <<< "$pair"
  [[ " ${parts[*]} " == *" $x "* && " ${parts[*]} " == *" $y "* ]] && {
    echo "parts $x and $y do not fit in one GPU's memory side by side: run them in separate calls" >&2; exit 2; }
done
mkdir -p "$OUT" "$dir"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
left=$(( ${DEADLINE:-570} - SECONDS - 30 ))
fused_modes="peer_compile_graph compile_graph fused:4"; fused_set=peer_compile_graph+compile_graph+fused:4
unfused_modes="peer_eager_graph serial_graph concur_graph:4"; unfused_set=peer_eager_graph+serial_graph+concur_graph:4
groups=()
# timeout leads a process group of the sweep and its children: on the deadline it ends them all
sweep() { timeout -k 5 $left python3 -m experiments.sweep --out "$dir" --resume --precisions bf16 --repeats 150 \
            --rounds 10 "$@" >> "$OUT/bench_$part.log" 2>&1 &
          groups+=($!); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
for part in "${parts[@]}"; do  # sweep() logs to the part's own file
case $part in
  a) sweep --models inception_v3 googlenet resnet50 --batches 8 64 --modes $fused_modes --together $fused_set \
           --compile-jobs 6 ;;
  b) sweep --models inception_v3 googlenet resnet50 --batches 8 64 --modes $unfused_modes --together $unfused_set \
           --compile-jobs 3 ;;
  c) sweep --models inception_v3 googlenet resnet50 --batches 8 64 --precisions fp32 --modes $fused_modes \
           --together $fused_set --compile-jobs 6 ;;
  d) sweep --models timm:inception_v4 --batches 8 --modes $fused_modes --together peer_compile_graph+fused:4 \
           --compile-jobs 2
     sweep --models timm:hrnet_w18_small timm:dla34 --batches 8 --modes $fused_modes --together $fused_set \
           --compile-jobs 2 ;;
  e) sweep --models torchvision:vit_b_16 --batches 32 64 --modes $fused_modes --together $fused_set --compile-jobs 2
     sweep --models inception_v3 googlenet resnet50 --batches 32 --modes $fused_modes --together $fused_set \
           --compile-jobs 3 ;;
  f) sweep --models inception_v3 googlenet resnet50 --batches 128 --modes $fused_modes --together $fused_set \
           --compile-jobs 3 ;;
  g) sweep --models timm:inception_v4 --batches 64 --modes $fused_modes --together peer_compile_graph+fused:4 \
           --compile-jobs 2
     sweep --models timm:hrnet_w18_small timm:dla34 --batches 64 --modes $fused_modes --together $fused_set \
           --compile-jobs 2 ;;
  h) sweep --models inception_v3 googlenet resnet50 --batches 32 --precisions fp32 --modes $fused_modes \
           --together $fused_set --compile-jobs 3 ;;
  i) sweep --models inception_v3 googlenet resnet50 --batches 128 --precisions fp32 --modes $fused_modes \
           --together $fused_set --compile-jobs 3 ;;
  j) sweep --models timm:hrnet_w18_small timm:dla34 --batches 8 --modes $unfused_modes --together $unfused_set \
           --compile-jobs 2 ;;
esac
done
wait
for g in "${groups[@]}"; do kill -- -"$g" 2>/dev/null; done  # a child left behind by a sweep that was cut off
python3 -m experiments.sweep --out "$dir" --report-only >> "$OUT/bench_report.log" 2>&1  # all parts' rows
for part in "${parts[@]}"; do grep -h ": ok\|error\|failed" "$OUT/bench_$part.log" | tail -40; done
tar czf "$OUT/bench.tgz" --exclude=traces --exclude=util "$dir"
