#!/usr/bin/env bash
# The zoo on the device: concur's defaults against PyTorch's own recipes (experiments/peers.py) on networks
# nobody tuned concur for, at batch 32, bf16 autocast + channels-last, SGD momentum. Each model is one child that
# compiles the recipe and concur's mode side by side with the other children and times the two in alternating
# rounds under one GPU lock (as recipes.sh). Each concur mode measures its decisions with a cold cache, kept in
# RUN_DIR/decisions/<config>/ for experiments/calibrate.py.
#   bash experiments/zoo.sh RUN_DIR PART [NETWORK ...]   (PART below; on one H200 z23 took 8 minutes, z1 6, u1 and
#                                                        u2 under 3 each, inductor's cache cold)
#   z1 z2 z3   fused default (train_step(compile=True), 4 streams) against peer_compile_graph, a third of the
#              timm zoo each
#   z4         the same on torchvision's GoogLeNet, Inception-v3 and ResNet-50
#   z23        z2 and z3 side by side over one run directory (one GPU lock): 15 networks in one call
#   u1 u2      unfused default (train_step, 4 streams) against peer_eager_graph, half of the zoo each
#   alone MODEL...           the named networks' fused default timed alone, one child at a time, as the pass below
#   alone-unfused MODEL...   the same unfused
# Networks below 0.99x of the recipe are timed again alone while the deadline allows (RUN_DIR/alone/): neighbours
# compiling on the host disturb a step's timing. Logs go to $OUT (default RUN_DIR-out); RUN_DIR is packed to
# $OUT/bench.tgz, with RUN_DIR/zoo_table.md and RUN_DIR/decisions.jsonl (experiments/zoo_decisions.py).
set -uo pipefail
dir=$1; part=$2; shift 2; OUT=${OUT:-$dir-out}; mkdir -p "$OUT" "$dir"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 TORCHINDUCTOR_COMPILE_THREADS=2
left=$(( ${DEADLINE:-570} - SECONDS - 30 ))
# multi-branch CNNs, plain CNNs, mobile nets and transformers: 22 timm networks
zoo1="timm:skresnet18 timm:dpn68 timm:dla34 timm:hrnet_w18_small timm:res2net50_26w_4s timm:resnest14d timm:mixnet_s"
zoo2="timm:selecsls42b timm:densenet121 timm:resnet18 timm:repvgg_a2 timm:cspresnet50 timm:gernet_s timm:regnety_016 timm:vit_small_patch16_224"
zoo3="timm:skresnet34 timm:mobilenetv3_large_100 timm:efficientnet_b0 timm:ghostnet_100 timm:deit_tiny_patch16_224 timm:convnext_atto timm:inception_v4"
torchvision="googlenet inception_v3 resnet50"
groups=()
sweep() { timeout -k 5 $left python3 -m experiments.sweep --out "$dir" --resume --precisions bf16 --batches 32 \
            --repeats 40 --rounds 6 "$@" >> "$OUT/bench_$part.log" 2>&1 &
          groups+=($!); }
fused() { sweep --models "$@" --modes peer_compile_graph fused:4 --together peer_compile_graph+fused:4 \
            --compile-jobs 8; }
unfused() { sweep --models "$@" --modes peer_eager_graph concur_graph:4 --together peer_eager_graph+concur_graph:4 \
              --compile-jobs 8; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
# alone ROUTE MODEL: one network timed in a child of its own, nothing compiling beside its timing, the recipe,
# concur's one-stream step and its default in turns (RUN_DIR/alone/), while the deadline allows
alone() {
  local left=$(( ${DEADLINE:-570} - SECONDS - 30 )) modes
  [ "$left" -gt 60 ] || return 1
  if [ "$1" = fused ]; then modes="peer_compile_graph compile_graph fused:4"
  else modes="peer_eager_graph serial_graph concur_graph:4"; fi
  timeout -k 5 $left python3 -m experiments.sweep --out "$dir/alone" --resume --precisions bf16 --batches 32 \
    --repeats 40 --rounds 6 --compile-jobs 1 --models "$2" --modes $modes --together "${modes// /+}" \
    < /dev/null >> "$OUT/bench_$part.log" 2>&1; }  # not a caller's loop's stdin: the list of networks
case $part in
  alone|alone-unfused) [ $# -gt 0 ] || { echo "$part: name the networks" >&2; exit 2; } ;;
  *) [ $# -eq 0 ] || { echo "$part takes no networks" >&2; exit 2; } ;;
esac
case $part in
  alone) for m in "$@"; do alone fused "$m" || break; done ;;
  alone-unfused) for m in "$@"; do alone unfused "$m" || break; done ;;
  z1) fused $zoo1 ;;
  z2) fused $zoo2 ;;
  z3) fused $zoo3 ;;
  z4) fused $torchvision ;;
  z23) fused $zoo2; fused $zoo3 ;;
  u1) unfused $zoo1 $zoo2 ;;
  u2) unfused $zoo3 $torchvision ;;
  *) echo "unknown part '$part': z1 z2 z3 z4 z23 u1 u2 alone alone-unfused" >&2; exit 2 ;;
esac
wait
for g in "${groups[@]}"; do kill -- -"$g" 2>/dev/null; done  # a child left behind by a sweep that was cut off
table=$dir
if [ "${part#alone}" = "$part" ]; then
  python3 -m experiments.sweep --out "$dir" --report-only >> "$OUT/bench_$part.log" 2>&1
  # each network below 0.99x of the recipe again alone, while time is left
  python3 -m experiments.zoo_decisions "$dir" --below 0.99 | while read -r model route; do
    alone "$route" "$model" || break
  done
else
  table=$dir/alone  # the alone parts time nothing else
fi
[ -d "$dir/alone" ] && python3 -m experiments.sweep --out "$dir/alone" --report-only >> "$OUT/bench_$part.log" 2>&1
# the zoo's table: each network against the recipe beside its decisions (per graph and over the whole step)
[ -d "$table" ] && python3 -m experiments.zoo_decisions "$table" --jsonl "$table/decisions.jsonl" > "$table/zoo_table.md" \
  2>> "$OUT/bench_$part.log"
grep -h ": ok\|error\|failed" "$OUT/bench_$part.log" | tail -40
tar czf "$OUT/bench.tgz" --exclude=traces --exclude=util "$dir"
