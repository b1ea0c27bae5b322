#!/usr/bin/env bash
# Device-machine checks in one call; each step writes under OUT/STEP/.
#   bash experiments/gpu_check.sh [--out DIR] STEP [STEP ...]      (OUT: $OUT where set, else --out)
# Steps:
#   tests      the cuda-marked pytest tier, one process per test file side by side (each fused-envelope test of
#              tests/test_gpu_backend.py in a process of its own), and examples/train.py with graphs (2 epochs,
#              then resumed for the third); one line each in OUT/tests/summary.txt, logs in OUT/tests/logs/.
#              The DDP tests need two GPUs and skip on one (the ddp step runs them)
#   sanitizer  every test of tests/test_gpu_backend.py that runs the fused path under the CUDA sanitizer (five
#              networks, three buffer-reuse variants), one process each; OUT/sanitizer/summary.txt
#   speed      experiments/recipes.sh SPEED_PARTS (default "a": three CNNs at b8 and b64, bf16, fused against
#              PyTorch's compile + whole-step-graph recipe) over OUT/speed/run; summary in OUT/speed/run/summary.md
#   memory     python -m experiments.memory (the memory-pressure benchmark) --out OUT/memory [--jobs MEMORY_JOBS]
#              [MEMORY_ARGS, e.g. "--paths unfused": a part of the grid]
#   stress     python -m experiments.capture_stress --out OUT/stress [STRESS_ARGS]: copies of the habits tests side by
#              side with sanitizer tests, every train_step capture counted (captured, failed, recovered, eager)
#   zoo        experiments/zoo.sh ZOO_PART (default z4: the three torchvision CNNs; z1 z2 z3 the timm networks,
#              u1 u2 unfused) over OUT/zoo/run; the table in OUT/zoo/run/zoo_table.md
#   ddp        tests/test_gpu_ddp.py, then with two GPUs or more experiments/ddp_train.py --compare, eager and
#              captured, on two of them; OUT/ddp/
#   setup      experiments/setup_cost.py, one setup at a time (setup times are wall times) for each of SETUP_SPECS
#              ("MODEL BATCH STREAMS [--compile]" separated by ";"), SETUP_PAIRS pairs each (default 1): what the
#              measured decisions add to setup; OUT/setup/setup.txt, OUT/setup/setup.jsonl
#   host       python -m experiments.host_time --profile 10 --python HOST_PYTHON (default 50) for each of
#              HOST_SPECS ("MODEL BATCH [--compile]" separated by ";", default "googlenet 8;resnet50 64 --compile"):
#              a synced step's host time per call before its replay, concur against the recipe, and the Python
#              functions by their own time; OUT/host/host.txt, OUT/host/host.jsonl
#   memdiff    experiments/memory_diff.py side by side for each of MEMDIFF_SPECS ("MODEL BATCH [--compile]" separated by
#              ";", default the fused GoogLeNet b8 and b64, Inception-v3 b32, ResNet-50 b8 and the unfused GoogLeNet
#              b8): the recipe, concur on MEMDIFF_STREAMS (default 4), the same with its decisions' timing off
#              (CONCUR_MEASURE=0) and without the step decision; what timing adds to setup's peak.
#              OUT/memdiff/memdiff.jsonl, OUT/memdiff/summary.txt
#   wrappers   golden wrappers + scheduler oracle (experiments/capture_wrappers.py) for GoogLeNet, Inception-v3
#              and ResNet-50 in fp32 and bf16, 6 processes side by side; packed to OUT/wrappers/wrappers_cuda.tgz
#   probe      experiments/caller_outputs.py's probe in each of PROBE_FORMS (default "backward-on-caller outputs"):
#              first tests/gpu_sanitized_run.py under it for GoogLeNet and Inception-v3, side by side; then, alone,
#              python -m experiments.memory with CONCUR_PROBE_CALLER_OUTPUTS set, --limit each of PROBE_LIMITS
#              (default 1.05), PROBE_ARGS (default: the unfused GoogLeNet and Inception-v3 b64, with --streams 2);
#              OUT/probe/summary.txt, OUT/probe/FORM_LIMIT/memory.jsonl
# DEADLINE (default 585 s) bounds the steps that run side by side, so what finished is written before the call's limit.
# Inductor's cache lives in the ignored .cache/ so a later call on the same warm machine reuses it.
set -uo pipefail
usage() { sed -n '2,/^set/p' "$0" | grep '^#' >&2; exit 2; }
if [ "${1:-}" = --out ]; then [ -n "${2:-}" ] || usage; OUT=$2; shift 2; fi
[ -n "${OUT:-}" ] || { echo "name the output folder: set OUT or pass --out DIR" >&2; usage; }
[ $# -gt 0 ] || usage
for step in "$@"; do  # every step known before any starts
  case "$step" in tests|sanitizer|speed|memory|stress|zoo|ddp|setup|host|memdiff|wrappers|probe) ;;
    *) echo "unknown step '$step': tests sanitizer speed memory stress zoo ddp setup host memdiff wrappers probe" >&2
       exit 2 ;; esac
done
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
cuda_ids() { python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::"; }
# Steps that run commands side by side: begin_parallel DIR, then "t LOG COMMAND..." per process (two compile workers
# each, logging to DIR/logs/LOG.log with its exit status last), then end_parallel DIR PATTERN: one line per log in
# DIR/summary.txt (exit status, log, the last lines matching PATTERN).
begin_parallel() { d=$1/logs; mkdir -p "$d"; left=$(( ${DEADLINE:-585} - SECONDS - 25 )); }
# processes side by side take turns to time their decisions (CONCUR_MEASURE_LOCK), which also tells concur they share
# the GPU on purpose: their decisions are reused as on a GPU of their own (concur.dag.measure.others_timing_beside)
t() { local name=$1; shift; (TORCHINDUCTOR_COMPILE_THREADS=2 CONCUR_GPU_STEPS=${CONCUR_GPU_STEPS:-30} \
        CONCUR_MEASURE_LOCK=${CONCUR_MEASURE_LOCK:-$OUT/.measure.lock} \
        timeout -k 5 $left "$@" > "$d/$name.log" 2>&1; echo "rc=$?" >> "$d/$name.log") & }
end_parallel() {
  local dir=$1 pattern=$2 log; wait
  for log in "$d"/*.log; do
    [ -e "$log" ] || continue
    echo "$(tail -1 "$log") $(basename "$log" .log): $(grep -h "$pattern" "$log" | tail -4 | tr '\n' ' ' | cut -c1-600)"
  done | sort | tee "$dir/summary.txt"; }
log_name() { echo "${1#*::}" | tr -c 'A-Za-z0-9_.\n-' '_'; }
results=" passed\| failed\|Error\|sanitized run finished\|deviation\|first update\|epoch"
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  dir=$OUT/$step; mkdir -p "$dir"
  case "$step" in
    tests) begin_parallel "$dir"
           for f in $(cuda_ids tests/ | cut -d: -f1 | sort -u); do
             if [ "$f" = tests/test_gpu_backend.py ]; then  # one envelope per process: each compiles a network
               for id in $(cuda_ids "$f" -k "not sanitizer"); do
                 t "$(log_name "$id")" python3 -m pytest -m cuda -q -s -p no:cacheprovider "$id"
               done
             else
               t "$(basename "$f" .py)" python3 -m pytest -m cuda -q -s -p no:cacheprovider "$f"
             fi
           done
           t example bash -c "python3 examples/train.py --epochs 3 --stop-after 2 --checkpoint '$dir/ckpt.pt' &&
                              python3 examples/train.py --epochs 3 --checkpoint '$dir/ckpt.pt' --resume '$dir/ckpt.pt'"
           end_parallel "$dir" "$results" ;;
    sanitizer) begin_parallel "$dir"
           for id in $(cuda_ids tests/test_gpu_backend.py -k sanitizer); do
             t "$(log_name "$id")" python3 -m pytest -m cuda -q -s -p no:cacheprovider "$id"
           done
           end_parallel "$dir" "$results" ;;
    speed) DEADLINE=$(( ${DEADLINE:-585} - SECONDS )) OUT=$dir bash "$(dirname "$0")/recipes.sh" "$dir/run" ${SPEED_PARTS:-a} ;;
    probe) forms=${PROBE_FORMS:-backward-on-caller outputs}
           begin_parallel "$dir"
           for form in $forms; do
             for m in googlenet inception_v3; do
               t "sanitizer_${m}_$form" python3 -m tests.gpu_sanitized_run --model "$m" --caller-outputs "$form"
             done
           done
           end_parallel "$dir" "sanitized run finished\|Error"
           for form in $forms; do  # alone: these rows time
             for limit in ${PROBE_LIMITS:-1.05}; do
               CONCUR_PROBE_CALLER_OUTPUTS=$form python3 -m experiments.memory --out "$dir/${form}_$limit" \
                 --limit "$limit" ${PROBE_ARGS:---paths unfused --networks googlenet inception_v3 --batches 64 \
                 --without-streams1 --streams 2 --timeout 100} 2>&1 | tee "$dir/${form}_$limit.log" | grep "|" | tail -4
             done
           done ;;
    memory) python3 -m experiments.memory --out "$dir" ${MEMORY_JOBS:+--jobs $MEMORY_JOBS} ${MEMORY_ARGS:-} 2>&1 \
              | tee "$dir/memory.log" | grep -v "Warning" | tail -30 ;;
    stress) python3 -m experiments.capture_stress --out "$dir" --deadline $(( ${DEADLINE:-585} - SECONDS - 20 )) \
              ${STRESS_ARGS:-} 2>&1 | tee "$dir/stress.log" | tail -12 ;;
    zoo) DEADLINE=$(( ${DEADLINE:-585} - SECONDS )) OUT=$dir bash "$(dirname "$0")/zoo.sh" "$dir/run" ${ZOO_PART:-z4} ;;
    ddp) python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_ddp.py 2>&1 | tee "$dir/test_gpu_ddp.log" \
           | tail -3
         if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # the all-reduce needs a second GPU to mean anything
           for graph in "" --cuda-graph; do
             CUDA_VISIBLE_DEVICES=0,1 python3 -m torch.distributed.run --nproc-per-node=2 experiments/ddp_train.py \
               --steps 20 --compare $graph 2>&1 | grep -v Warning | tee -a "$dir/ddp_train.log" | tail -8
           done
         fi ;;
    setup) IFS=';' read -ra specs <<< "${SETUP_SPECS:-googlenet 32 4 --compile;googlenet 32 auto --compile;googlenet 32 4}"
           for spec in "${specs[@]}"; do
             read -r m b s c <<< "$spec"
             timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 10 )) python3 -m experiments.setup_cost --model "$m" \
               --batch "$b" --streams "$s" ${c:-} --pairs ${SETUP_PAIRS:-1} --json "$dir/setup.jsonl" 2>&1 \
               | grep -v Warning | tee -a "$dir/setup.txt"
           done ;;
    host) IFS=';' read -ra specs <<< "${HOST_SPECS:-googlenet 8;resnet50 64 --compile}"
          for spec in "${specs[@]}"; do
            read -r m b c <<< "$spec"
            timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 10 )) python3 -m experiments.host_time --model "$m" \
              --batch "$b" ${c:-} --profile 10 --python ${HOST_PYTHON:-50} --json "$dir/host.jsonl" 2>&1 \
              | grep -v Warning | tee -a "$dir/host.txt"
          done ;;
    memdiff) begin_parallel "$dir"
             default="googlenet 8 --compile;googlenet 64 --compile;inception_v3 32 --compile;resnet50 8 --compile"
             IFS=';' read -ra specs <<< "${MEMDIFF_SPECS:-$default;googlenet 8}"
             for spec in "${specs[@]}"; do
               read -r m b c <<< "$spec"
               name=${m}_b$b${c:+_c}
               run=(python3 -m experiments.memory_diff --model "$m" --batch "$b" ${c:-})
               # one JSON file per process: lines of processes side by side never interleave
               t "${name}_recipe" "${run[@]}" --who recipe --json "$d/${name}_recipe.jsonl"
               run+=(--who concur --streams "${MEMDIFF_STREAMS:-4}")
               t "${name}_concur" "${run[@]}" --json "$d/${name}_concur.jsonl"
               t "${name}_timing_off" env CONCUR_MEASURE=0 "${run[@]}" --json "$d/${name}_timing_off.jsonl"
               t "${name}_no_step_decision" "${run[@]}" --no-step-decision --json "$d/${name}_no_step_decision.jsonl"
             done
             end_parallel "$dir" "setup_peak"
             cat "$d"/*.jsonl > "$dir/memdiff.jsonl" ;;
    wrappers) for m in googlenet inception_v3 resnet50; do for p in fp32 bf16_cl; do
                timeout 540 python3 -m experiments.capture_wrappers --device cuda --models $m --precisions $p \
                  --out "$dir/wrappers" > "$dir/capture_${m}_$p.log" 2>&1 &
              done; done; wait
              grep -h "wrote\|FAILED" "$dir"/capture_*.log
              [ -d "$dir/wrappers" ] && tar czf "$dir/wrappers_cuda.tgz" -C "$dir/wrappers" . && rm -rf "$dir/wrappers" ;;
  esac
done
wait
echo "=== done ($(date +%T))"
