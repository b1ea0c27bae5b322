#!/usr/bin/env bash
# Device-machine checks in one call; every log and result lands under $OUT.
#   bash experiments/gpu_check.sh STEP [STEP ...]
# Steps:
#   tests          GPU tests of the runtime and tuner (tests/test_gpu.py, tests/test_gpu_tuner.py)
#   fused:MODEL    GPU test of the fused path for one model (googlenet, inception_v3, resnet50)
#   csan:MODEL     the fused path under the CUDA sanitizer (googlenet, inception_v3, resnet50)
#   fused-no-reuse:MODEL, csan-no-reuse:MODEL   the same with buffer_reuse=False
#   fused-all      every test of tests/test_gpu_backend.py (training envelope and sanitizer; GoogLeNet,
#                  Inception-v3, ResNet-50, timm hrnet_w18_small and dla34; buffer reuse on and off) in
#                  its own process, all side by side; logs in $OUT/fused_all/, one line each in
#                  $OUT/fused_all.txt (PASS, FAIL, SKIP or TIMEOUT). CONCUR_GPU_STEPS (default 30 here)
#   final          in parallel processes: the train_step habits (tests/test_gpu_train_habits.py), tests/test_gpu.py,
#                  the tuner and DDP tests, the fused sanitizer runs (5 models, reuse on and off) and
#                  examples/train.py with graphs (2 epochs, then resumed for the third); one line each in
#                  $OUT/final.txt, logs packed in $OUT/final_logs.tgz. The DDP tests need two GPUs and skip on
#                  one ("2 skipped" on the tuner_ddp line): run the step on nvidia-h100-x2
#   check22        in parallel processes: the fused envelope (5 models) and sanitizer (3 models) with the
#                  backend's defaults (gate, weight-gradient split, no reuse), and the train_step habits of the
#                  branchy net incl. stream_priority; one line each in $OUT/check22.txt, logs in $OUT/check22_logs.tgz
#   recheck        in parallel processes: the fused envelope (4 models) and sanitizer (3 models) with
#                  buffer_reuse="ordered", the unfused path's weight-gradient split (tests/test_gpu_weight_grads.py),
#                  the train_step habits (default stream priority), tests/test_gpu.py and the DDP test;
#                  one line each in $OUT/recheck.txt, logs in $OUT/recheck_logs.tgz
#   lean           in parallel processes: the lean captured step against PyTorch's recipe (tests/test_gpu_lean_step.py:
#                  kernels and memory), the train_step habits, tests/test_gpu.py, the unfused weight-gradient split,
#                  the fused envelope and sanitizer (GoogLeNet, ResNet-50); $OUT/lean.txt, $OUT/lean_logs.tgz
#   mem28          experiments/memory_diff.py, recipe and concur (4 streams) side by side: GoogLeNet b8, Inception-v3
#                  b32, ResNet-50 b8 compiled, GoogLeNet b8 and ResNet-50 b32 unfused; $OUT/mem28.txt, $OUT/mem28.jsonl
#   mem30          experiments/memory_diff.py (held memory by pool and stream): recipe and concur (4 streams),
#                  GoogLeNet b8/b64, Inception-v3 b32, ResNet-50 b8 compiled, GoogLeNet b8 unfused;
#                  $OUT/mem30.txt, $OUT/mem30.jsonl, $OUT/mem30_logs.tgz
#   pool30         setup's timing pool given back before the step's capture: memory_diff.py (concur, 4 streams: GoogLeNet
#                  b8, Inception-v3 b32, ResNet-50 b8 compiled; GoogLeNet b8, ResNet-50 b32 unfused) beside the lean-step,
#                  step-decision and habits tests; $OUT/pool30.txt, $OUT/pool30.jsonl, $OUT/pool30_logs.tgz
#   setup31        each timing in a pool of its own given back when it ends, rounds that stop once settled:
#                  memory_diff.py (concur, 4 streams: GoogLeNet b8/b64, Inception-v3 b32, ResNet-50 b8 compiled;
#                  GoogLeNet b8, ResNet-50 b32 unfused) beside the lean-step, step-decision and measure tests;
#                  $OUT/setup31.txt, $OUT/setup31.jsonl, $OUT/setup31_logs.tgz
#   gap            experiments/memory_diff.py (who holds setup and steady memory, concur vs the recipe) and
#                  experiments/step_gap.py (streams=1 vs the recipe: replay alone, host time, kernel time by name)
#   final28        lean step, habits, test_gpu, measured-decision tests, weight grads, fused envelope and sanitizer
#                  (GoogLeNet, ResNet-50) and memory_diff side by side; then experiments/decision_check.py alone
#   split29        the weight-gradient split made in the multi-stream program only: the fused envelope (GoogLeNet,
#                  ResNet-50, ResNeSt-14d) and sanitizer (GoogLeNet, ResNeSt-14d) with the default reuse, and the
#                  high-priority habits test, side by side; $OUT/split29.txt, $OUT/split29_logs.tgz
#   step29         train_step(compile=True) deciding its streams on the whole captured step (tests/test_gpu_step_streams.py),
#                  the habits, lean-step and measure tests, the fused envelope (GoogLeNet, ResNeSt-14d) and sanitizer
#                  (GoogLeNet), side by side; $OUT/step29.txt, $OUT/step29_logs.tgz
#   auto29         streams="auto" (tests/test_gpu.py -k auto_streams) beside the step, habits, lean-step and measure
#                  tests, side by side; then a sweep of fused:4 and fused:auto against compile + graph (AUTO29_MODELS,
#                  b32 bf16); $OUT/auto29.txt, $OUT/auto29_logs.tgz, $OUT/auto29_sweep.log, $OUT/auto29_sweep.tgz
#   shared         tests/test_gpu.py, the habits, lean-step and step-decision tests, the fused envelope (GoogLeNet) and
#                  sanitizer (GoogLeNet, Inception-v3), side by side; $OUT/shared.txt, $OUT/shared_logs.tgz
#   setup29        experiments/setup_cost.py: what the measured decisions add to setup (timing on against off, warm
#                  inductor cache), fused GoogLeNet b32 on 4 streams and "auto", fused ResNet-50 b32, unfused
#                  GoogLeNet b32, one at a time; $OUT/setup29.txt, $OUT/setup29.jsonl
#   profile29      experiments/setup_cost.py --profile: where an unfused setup's seconds go, timing on and off
#                  (GoogLeNet and ResNet-50 b32, 4 streams), then setup29 of the same two; $OUT/profile29.txt
#   trial29        an unfused step times its programs on its first calls (concur.training.trial): tests/test_gpu.py,
#                  the habits, lean-step, step-decision and weight-gradient tests and memory_diff.py (recipe and
#                  concur, GoogLeNet b8/b64, ResNet-50 b32 unfused) side by side; $OUT/trial29.txt,
#                  $OUT/trial29.jsonl, $OUT/trial29_logs.tgz (setup29 with SETUP29_SPECS times its setup cost)
#   verify30       tests/test_gpu.py, the habits, lean-step, step-decision, weight-gradient and measure tests and
#                  memory_diff.py (concur unfused, GoogLeNet b64/b8) side by side; then VERIFY30_MODELS (default: three
#                  timm networks) alone at b32 bf16: the eager-graph recipe, serial_graph and concur_graph:4 in one
#                  child; $OUT/verify30.txt, $OUT/verify30_logs.tgz, $OUT/verify30_sweep.log, $OUT/verify30_sweep.tgz
#   emit30         the fused route's checks after emission stopped copying the wrapper (the auto and fused tests of
#                  tests/test_gpu.py, the step decision, the lean step's fused test, the fused envelope and sanitizer on
#                  GoogLeNet) side by side; then setup29 on EMIT30_SPECS (default: fused GoogLeNet b32, streams="auto")
#   checks32       trace31's checks alone (the measured decisions on the fused route, side by side), and beside them what
#                  NVML lists of the other processes on the GPU (concur.dag.nvml); $OUT/checks32.txt, $OUT/checks32_logs.tgz
#   trace31        emit30's checks and tests/test_measure.py side by side with a cold setup of fused GoogLeNet b32
#                  (it warms inductor's cache); then,
#                  one at a time, setup_cost.py --trace on TRACE31_SPECS (streams and CONCUR_MEASURE, default: auto and
#                  4, timing on, on with --keep-cache, and off): where setup's CUDA-graph work goes; $OUT/trace31.txt
#   cost31         what the measured decisions add to fused GoogLeNet b32's setup: setup29 with COST31_PAIRS (default 3)
#                  warm pairs on streams="auto" (tests/test_gpu.py's auto test beside its cold pair), then trace31's
#                  --trace of "auto" and 4 streams with timing on, then setup29 on 4 streams; $OUT/setup29.txt,
#                  $OUT/setup29.jsonl, $OUT/trace31.txt, $OUT/auto_test.log
#   mem32          setup and steady memory of the fused default with its measured decisions and without (CONCUR_MEASURE=0),
#                  beside the recipe: memory_diff.py, GoogLeNet b8/b64, Inception-v3 b32, ResNet-50 b8 compiled and
#                  GoogLeNet b8 unfused, one process each; $OUT/mem32.txt, $OUT/mem32.jsonl, $OUT/mem32_logs.tgz
#   ordered        recheck's first part only: the fused envelope and sanitizer with buffer_reuse="ordered";
#                  $OUT/ordered.txt, $OUT/ordered_logs.tgz
#   probe-streams  does this torch's inductor assign streams per fx node (node.meta["custom"]["stream"])?
#                  greps its source and packs torch/_inductor's top-level modules to $OUT/inductor_src.tgz
#   capture-wrappers  golden wrappers + scheduler oracle (experiments/capture_wrappers.py), 6 in parallel,
#                  packed to $OUT/wrappers_cuda.tgz
#   wrappers       copy a few of inductor's generated wrappers (python files with a call function) to $OUT
#   zoo-giants     the two largest torchvision models on the CPU (they need >23 GB of RAM), in the background
#   bench          bench_train.py: the README's runtime table (3 models, all batches, 2/4/8 streams)
#   quick          bench_train.py on GoogLeNet and Inception-v3, batch 8 and 64
#   tuner          issue 4's tuner-vs-sweep report
#   scaling        python -m experiments.scaling (branch count x width), resumed in the run directory
#                  beside the sweep, copied to $OUT/scaling.tgz
#   sweep:ARGS     python -m experiments.sweep ARGS (commas for spaces), resumed in
#                  experiments/results/$SWEEP_DIR and copied to $OUT/sweep.tgz
# DEADLINE (default 585 s) bounds a sweep step so its results are packed before the call's limit.
# Inductor's cache lives in the ignored .cache/ so a later call on the same warm machine reuses it.
set -uo pipefail
[ $# -gt 0 ] || { sed -n '2,/^set/p' "$0" | grep '^#'; exit 2; }
OUT=${OUT:-/tmp/concur_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
SWEEP_DIR=${SWEEP_DIR:-2026-11-22-h100-torch2.11/sweep}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
pytest_cuda() { python3 -m pytest -m cuda -q -s --no-header -p no:cacheprovider "$@"; }
# Steps that run commands side by side: begin_parallel NAME, then "t LOG COMMAND..." per process (two compile
# workers each, logging to $d/LOG.log with its exit status last), then end_parallel NAME PATTERN LINES WIDTH:
# one line per log in $OUT/NAME.txt (exit status, log, its last LINES lines matching PATTERN), logs packed.
begin_parallel() { d=/tmp/$1_logs; rm -rf "$d"; mkdir -p "$d"; left=$(( ${DEADLINE:-585} - SECONDS - 25 )); }
# processes side by side take turns to time their decisions (CONCUR_MEASURE_LOCK), which also tells concur they share
# the GPU on purpose: their decisions are reused as on a GPU of their own (concur.dag.measure.others_timing_beside)
t() { local name=$1; shift; (TORCHINDUCTOR_COMPILE_THREADS=2 CONCUR_GPU_STEPS=${CONCUR_GPU_STEPS:-30} \
        CONCUR_MEASURE_LOCK=${CONCUR_MEASURE_LOCK:-/tmp/concur_gpu_check.lock} \
        timeout -k 5 $left "$@" > "$d/$name.log" 2>&1; echo "rc=$?" >> "$d/$name.log") & }
end_parallel() {
  local name=$1 pattern=$2 lines=$3 width=$4 log; wait
  for log in "$d"/*.log; do
    echo "$(tail -1 "$log") $(basename "$log" .log): $(grep -h "$pattern" "$log" | tail -$lines | tr '\n' ' ' | cut -c1-$width)"
  done | sort | tee "$OUT/$name.txt"
  tar czf "$OUT/${name}_logs.tgz" -C "$d" . ; }
# fused_checks REUSE "MODELS" "MODELS": the fused envelope on the first models and the sanitizer on the second, with
# test_gpu_backend.py's buffer_reuse variant REUSE (reuse, no_reuse, ordered_reuse), one process each
fused_checks() {
  local m
  for m in $2; do
    t "envelope_$m" python3 -m pytest -m cuda -q -s -p no:cacheprovider \
      "tests/test_gpu_backend.py::test_fused_train_step_matches_eager_within_compiles_own_envelope[$m-$1]"
  done
  for m in $3; do
    t "csan_$m" python3 -m pytest -m cuda -q -s -p no:cacheprovider \
      "tests/test_gpu_backend.py::test_fused_path_under_the_sanitizer_reports_no_race[$m-$1]"
  done; }
# memory_diffs JSON "WHO ..." "MODEL BATCH [--compile]" ...: experiments/memory_diff.py for each side (recipe, or
# concur on 4 streams) and configuration, one process each (allocator statistics are per process); logs mem_*.log
memory_diffs() {
  local json=$1 whos=$2 spec who m b c; shift 2
  for spec in "$@"; do
    read -r m b c <<< "$spec"
    for who in $whos; do
      t "mem_${m}_b${b}${c:+_c}_$who" python3 experiments/memory_diff.py --model $m --batch $b $c --who $who \
        $([ "$who" = concur ] && echo --streams 4) --json "$json"
    done
  done; }
# the measured decisions on the fused route, side by side: "auto" and the fused tests of tests/test_gpu.py, the step
# decision, the lean step's fused test, tests/test_measure.py, the fused envelope and sanitizer on GoogLeNet
decision_checks() {
  t auto python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py -k "auto_streams or fused"
  t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
  t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py -k fused
  t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_measure.py
  fused_checks ordered_reuse "googlenet" "googlenet"; }
ordered_reuse_checks() { fused_checks ordered_reuse "googlenet inception_v3 resnet50 hrnet_w18_small" \
                           "googlenet inception_v3 resnet50"; }
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    tests) pytest_cuda tests/test_gpu.py tests/test_gpu_tuner.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^W1\|Warning" | tail -15 ;;
    fused:*) pytest_cuda tests/test_gpu_backend.py -k "envelope and ${step#fused:} and not no_reuse" 2>&1 \
               | tee "$OUT/gpu_fused_${step#fused:}.log" | grep -v "^W1\|Warning" | tail -8 ;;
    fused-no-reuse:*) pytest_cuda tests/test_gpu_backend.py -k "envelope and ${step#*:} and no_reuse" 2>&1 \
               | tee "$OUT/gpu_fused_no_reuse_${step#*:}.log" | grep -v "^W1\|Warning" | tail -8 ;;
    csan:*) pytest_cuda tests/test_gpu_backend.py -k "sanitizer and ${step#csan:} and not no_reuse" 2>&1 \
               | tee "$OUT/gpu_csan_${step#csan:}.log" | tail -5 ;;
    csan-no-reuse:*) pytest_cuda tests/test_gpu_backend.py -k "sanitizer and ${step#*:} and no_reuse" 2>&1 \
               | tee "$OUT/gpu_csan_no_reuse_${step#*:}.log" | tail -5 ;;
    fused-all) mkdir -p "$OUT/fused_all"; left=$(( ${DEADLINE:-585} - SECONDS - 25 ))
             ids=$(python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider tests/test_gpu_backend.py 2>/dev/null \
                     | grep "::")
             for id in $ids; do  # two compile workers each: 20 processes share 16 cores
               log="$OUT/fused_all/$(echo "${id#*::}" | tr -c 'A-Za-z0-9_.\n-' '_').log"
               TORCHINDUCTOR_COMPILE_THREADS=2 CONCUR_GPU_STEPS=${CONCUR_GPU_STEPS:-30} timeout -k 5 $left \
                 python3 -m pytest -m cuda -q -s --no-header -p no:cacheprovider "$id" > "$log" 2>&1 &
             done; wait
             for log in "$OUT"/fused_all/*.log; do
               if grep -q " passed" "$log"; then r=PASS; elif grep -q " failed\| error" "$log"; then r=FAIL
               elif grep -q " skipped" "$log"; then r=SKIP; else r=TIMEOUT; fi
               echo "$r $(basename "$log" .log) $(grep -h "first update error\|sanitized run finished" "$log" | tail -1)"
             done | sort | tee "$OUT/fused_all.txt" ;;
    final) begin_parallel final
             t habits_branchy python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py -k branchy
             t habits_googlenet python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py -k googlenet
             t gpu_train_step python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py -k train_step
             t gpu_other python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py -k "not train_step"
             t tuner_ddp python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_tuner.py tests/test_gpu_ddp.py
             for id in $(python3 -m pytest -m cuda -q --collect-only -p no:cacheprovider tests/test_gpu_backend.py \
                           -k sanitizer 2>/dev/null | grep "::"); do
               t "csan_$(echo "${id#*::}" | tr -c 'A-Za-z0-9_.\n-' '_')" python3 -m pytest -m cuda -q -s -p no:cacheprovider "$id"
             done
             t example bash -c "python3 examples/train.py --epochs 3 --stop-after 2 --checkpoint /tmp/ckpt.pt &&
                                python3 examples/train.py --epochs 3 --checkpoint /tmp/ckpt.pt --resume /tmp/ckpt.pt"
             end_parallel final " passed\| failed\|error\|sanitized run finished\|epoch" 3 400 ;;
    check22) begin_parallel check22
             t habits_branchy_priority python3 -m pytest -m cuda -q -s -p no:cacheprovider \
               tests/test_gpu_train_habits.py -k "branchy or priority"
             fused_checks no_reuse "googlenet inception_v3 resnet50 dla34 hrnet_w18_small" "googlenet inception_v3 resnet50"
             end_parallel check22 " passed\| failed\|Error\|sanitized run finished\|deviation\|first update" 4 500 ;;
    recheck) begin_parallel recheck
             ordered_reuse_checks
             t weight_grads python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_weight_grads.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py
             t ddp python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_ddp.py
             end_parallel recheck " passed\| failed\|Error\|sanitized run finished\|deviation\|first update" 4 500 ;;
    lean) begin_parallel lean
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py
             t weight_grads python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_weight_grads.py
             fused_checks ordered_reuse "googlenet resnet50" "googlenet resnet50"
             end_parallel lean " passed\| failed\|Error\|sanitized run finished\|deviation\|first update\|kernels per\|memory, concur" 5 900 ;;
    mem28) begin_parallel mem28  # memory_diff.py per side, one process each (allocator statistics are per process)
             memory_diffs $OUT/mem28.jsonl "recipe concur" "googlenet 8 --compile" "inception_v3 32 --compile" \
               "resnet50 8 --compile" "googlenet 8" "resnet50 32"
             end_parallel mem28 "_mb\|Error" 2 400 ;;
    mem30) begin_parallel mem30  # memory_diff.py: the recipe and concur, held memory by pool and stream
             memory_diffs $OUT/mem30.jsonl "recipe concur" "googlenet 8 --compile" "googlenet 64 --compile" \
               "inception_v3 32 --compile" "resnet50 8 --compile" "googlenet 8"
             end_parallel mem30 "_mb\|Error" 2 400 ;;
    pool30) begin_parallel pool30  # setup's timings in a pool given back before the step's capture: memory, then tests
             memory_diffs $OUT/pool30.jsonl concur "googlenet 8 --compile" "inception_v3 32 --compile" \
               "resnet50 8 --compile" "googlenet 8" "resnet50 32"
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             end_parallel pool30 "_mb\| passed\| failed\|Error\|memory, " 4 600 ;;
    setup31) begin_parallel setup31  # timings in pools given back when each ends: memory, then tests
             memory_diffs $OUT/setup31.jsonl concur "googlenet 8 --compile" "googlenet 64 --compile" \
               "inception_v3 32 --compile" "resnet50 8 --compile" "googlenet 8" "resnet50 32"
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider \
               tests/test_measure.py tests/test_gpu.py -k "alternating or boxed or optimize_times or auto_streams"
             end_parallel setup31 "_mb\| passed\| failed\|Error\|memory, " 4 600 ;;
    gap) begin_parallel gap  # who holds the memory (in parallel: allocator stats are per process), then timing alone
             for who in recipe concur; do
               t "mem_r50_eager_$who" python3 experiments/memory_diff.py --who $who --json $OUT/gap_memory.jsonl
               t "mem_googlenet_compiled_$who" python3 experiments/memory_diff.py --model googlenet --compile \
                 --who $who --json $OUT/gap_memory.jsonl
             done
             t mem_r50_eager_concur4 python3 experiments/memory_diff.py --who concur --streams 4 --json $OUT/gap_memory.jsonl
             t mem_googlenet_compiled_concur4 python3 experiments/memory_diff.py --model googlenet --compile \
               --who concur --streams 4 --json $OUT/gap_memory.jsonl
             end_parallel gap "MB\|Error" 40 100000
             for a in "--model resnet50" "--model resnet50 --compile" "--model googlenet --compile"; do
               timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 15 )) python3 experiments/step_gap.py $a \
                 --json "$OUT/gap_time.jsonl" 2>&1 | grep -v Warning | tee -a "$OUT/gap_time.txt"
             done ;;
    final28) begin_parallel final28  # correctness side by side, then the measured decisions alone (timing)
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py
             t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_measure.py
             t weight_grads python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_weight_grads.py
             fused_checks ordered_reuse "googlenet resnet50" "googlenet resnet50"
             for who in recipe concur; do
               t "mem_r50_eager_$who" python3 experiments/memory_diff.py --who $who --json $OUT/final_memory.jsonl
             done
             for who in recipe concur; do  # compiled, 4 streams, decisions measured on the first call's inputs
               for m in googlenet resnet50; do
                 t "mem_${m}_compiled_$who" python3 experiments/memory_diff.py --model $m --compile \
                   --who $who --streams 4 --json $OUT/final_memory.jsonl
               done
             done
             end_parallel final28 " passed\| failed\|Error\|sanitized run finished\|deviation\|kernels per\|memory, concur\|_mb" 5 900
             timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 10 )) python3 experiments/decision_check.py \
               --models torchvision:googlenet torchvision:resnet50 timm:skresnet18 --batch 32 2>&1 \
               | grep -v Warning | tee "$OUT/decision_fused.txt" | tail -30 ;;
    split29) begin_parallel split29
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py -k priority
             fused_checks ordered_reuse "googlenet resnet50 resnest14d" "googlenet resnest14d"
             end_parallel split29 " passed\| failed\|Error\|sanitized run finished\|deviation" 4 600 ;;
    step29) begin_parallel step29  # the decision over the whole compiled step, and what it must not break
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_measure.py
             fused_checks ordered_reuse "googlenet resnest14d" "googlenet"
             end_parallel step29 " passed\| failed\|Error\|sanitized run finished\|deviation\|the step:" 4 600 ;;
    auto29) begin_parallel auto29  # streams="auto" as one decision among 2-4 streams and one, then the step split's tests
             t auto python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py -k auto_streams
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_measure.py
             end_parallel auto29 " passed\| failed\|Error\|auto with compile\|the step:" 4 600
             # fused on 4 streams and on "auto" against compile + graph, timed in alternating rounds under one lock
             timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 30 )) python3 -m experiments.sweep --out /tmp/auto29 \
               --resume --precisions bf16 --batches 32 --repeats 40 --rounds 6 --compile-jobs 8 \
               --models ${AUTO29_MODELS:-googlenet timm:skresnet18 timm:dla34 timm:vit_small_patch16_224} \
               --modes peer_compile_graph fused:4 fused:auto --together peer_compile_graph+fused:4+fused:auto \
               > "$OUT/auto29_sweep.log" 2>&1
             python3 -m experiments.sweep --out /tmp/auto29 --report-only >> "$OUT/auto29_sweep.log" 2>&1
             tar czf "$OUT/auto29_sweep.tgz" --exclude=traces --exclude=util -C /tmp auto29 ;;
    shared) begin_parallel shared  # plans share their device's side streams: correctness, then memory (mem28)
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             fused_checks ordered_reuse "googlenet" "googlenet inception_v3"
             end_parallel shared " passed\| failed\|Error\|sanitized run finished\|deviation\|memory, " 4 600 ;;
    setup29) IFS=';' read -ra specs <<< "${SETUP29_SPECS:-googlenet 32 4 --compile;googlenet 32 auto --compile;resnet50 32 4 --compile;googlenet 32 4}"
             for spec in "${specs[@]}"; do  # one at a time: setup times are wall times
               set -- $spec
               timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 10 )) python3 -m experiments.setup_cost --model $1 \
                 --batch $2 --streams $3 ${4:-} --pairs ${SETUP29_PAIRS:-1} --json "$OUT/setup29.jsonl" 2>&1 | grep -v Warning \
                 | tee -a "$OUT/setup29.txt"
             done ;;
    profile29) for m in googlenet resnet50; do for on in 1 0; do
                 python3 -m experiments.setup_cost --model $m --batch 32 --streams 4 --profile --measure $on 2>&1 \
                   | grep -v Warning >> "$OUT/profile29.txt"
               done; done
               SETUP29_SPECS="googlenet 32 4;resnet50 32 4" bash "$0" setup29 ;;
    trial29) begin_parallel trial29
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py ${TRIAL29_QUICK:+-k first_calls}
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             if [ -z "${TRIAL29_QUICK:-}" ]; then  # TRIAL29_QUICK=1: the trial's own test, the habits and memory only
               t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
               t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
               t weight_grads python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_weight_grads.py
             fi
             memory_diffs "$OUT/trial29.jsonl" "recipe concur" "googlenet 8" "googlenet 64" "resnet50 32"
             end_parallel trial29 " passed\| failed\|Error\|trial:\|memory, \|held_reserved" 4 700 ;;
    verify30) begin_parallel verify30  # the GPU tests on the current tree side by side, then zoo rows again alone
             t gpu python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py
             t habits python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_train_habits.py
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t weight_grads python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_weight_grads.py
             t measure python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_measure.py
             memory_diffs "$OUT/verify30.jsonl" concur "googlenet 64" "googlenet 8"
             end_parallel verify30 " passed\| failed\|Error\|trial:\|memory, \|held_reserved" 4 700
             # each named network alone (one child at a time, nothing compiling beside its timing): the recipe,
             # concur's one-stream step and its default, in alternating rounds
             timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 20 )) python3 -m experiments.sweep --out /tmp/verify30 \
               --resume --precisions bf16 --batches 32 --repeats 40 --rounds 6 --compile-jobs 1 \
               --models ${VERIFY30_MODELS:-timm:convnext_atto timm:efficientnet_b0 timm:deit_tiny_patch16_224} \
               --modes peer_eager_graph serial_graph concur_graph:4 \
               --together peer_eager_graph+serial_graph+concur_graph:4 > "$OUT/verify30_sweep.log" 2>&1
             python3 -m experiments.sweep --out /tmp/verify30 --report-only >> "$OUT/verify30_sweep.log" 2>&1
             grep "_graph.*peer_eager_graph |" /tmp/verify30/summary.md | head -12
             tar czf "$OUT/verify30_sweep.tgz" --exclude=traces --exclude=util -C /tmp verify30 ;;
    emit30) begin_parallel emit30  # programs built sharing the wrapper's nodes: the fused checks, then auto's setup cost
             t auto python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py -k "auto_streams or fused"
             t step_streams python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_step_streams.py
             t lean python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu_lean_step.py -k fused
             fused_checks ordered_reuse "googlenet" "googlenet"
             end_parallel emit30 " passed\| failed\|Error\|sanitized run finished\|deviation\|the step:" 4 600
             SETUP29_SPECS="${EMIT30_SPECS:-googlenet 32 auto --compile}" bash "$0" setup29 ;;
    checks32) begin_parallel checks32  # the measured decisions' checks after their cache key changed
             decision_checks
             # what NVML lists in this machine's container beside the checks (concur.dag.nvml): other processes
             t nvml python3 -c "import os, time, torch, pynvml; torch.zeros(1, device='cuda')
torch.compile(lambda x: (x * 2).relu())(torch.ones(8, device='cuda')); time.sleep(60)
from concur.dag.nvml import other_processes_on; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
print('NVML lists', sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)), 'this process', os.getpid(),
      'children', open(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read().split(),
      'other processes on GPU 0 (NVML):', other_processes_on(0))"
             end_parallel checks32 " passed\| failed\|Error\|sanitized run finished\|deviation\|the step:\|NVML" 4 600 ;;
    trace31) begin_parallel trace31  # the fused checks beside a cold setup, then where the captures' seconds go
             [ -n "${TRACE31_ONLY:-}" ] || {  # TRACE31_ONLY=1: the traces alone (inductor's cache warm already)
             decision_checks
             t cold python3 -m experiments.setup_cost --model googlenet --batch 32 --compile --streams auto --trace \
               --measure 0
             end_parallel trace31 " passed\| failed\|Error\|sanitized run finished\|deviation\|the step:\|setup " 4 600; }
             IFS=';' read -ra specs <<< "${TRACE31_SPECS:-auto 1;auto 1 --keep-cache;auto 0;4 1;4 1 --keep-cache;4 0}"
             for spec in "${specs[@]}"; do  # one at a time: wall times
               set -- $spec
               timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 10 )) python3 -m experiments.setup_cost --model googlenet \
                 --batch 32 --compile --streams $1 --measure $2 ${3:-} --trace 2>&1 | grep -v Warning \
                 | sed -n '/^setup /,$p' | tee -a "$OUT/trace31.txt"
             done ;;
    cost31) pytest_cuda tests/test_gpu.py -k auto_streams > "$OUT/auto_test.log" 2>&1 &  # each part within what is left
            DEADLINE=$(( ${DEADLINE:-585} - SECONDS )) SETUP29_PAIRS=${COST31_PAIRS:-3} \
              SETUP29_SPECS="googlenet 32 auto --compile" bash "$0" setup29
            wait; tail -1 "$OUT/auto_test.log"
            DEADLINE=$(( ${DEADLINE:-585} - SECONDS )) TRACE31_ONLY=1 TRACE31_SPECS="auto 1;4 1" bash "$0" trace31
            DEADLINE=$(( ${DEADLINE:-585} - SECONDS )) SETUP29_PAIRS=${COST31_PAIRS:-3} \
              SETUP29_SPECS="googlenet 32 4 --compile" bash "$0" setup29 ;;
    mem32) begin_parallel mem32  # how much of setup's memory over the recipe's is the measured decisions'
             specs=("googlenet 8 --compile" "googlenet 64 --compile" "inception_v3 32 --compile" "resnet50 8 --compile"
                    "googlenet 8")
             memory_diffs $OUT/mem32.jsonl "recipe concur" "${specs[@]}"
             for spec in "${specs[@]}"; do
               read -r m b c <<< "$spec"
               t "mem_${m}_b${b}${c:+_c}_concur_timing_off" env CONCUR_MEASURE=0 python3 experiments/memory_diff.py \
                 --model $m --batch $b $c --who concur --streams 4 --json $OUT/mem32.jsonl
             done
             end_parallel mem32 "_mb\|Error" 2 400 ;;
    ordered) begin_parallel ordered
             ordered_reuse_checks
             end_parallel ordered " passed\| failed\|Error\|sanitized run finished\|deviation\|first update" 4 500 ;;
    probe-streams) src=$(python3 -c "import torch._inductor as i, os; print(os.path.dirname(i.__file__))")
             grep -n "_get_node_stream\|_populate_stream_assignments\|record_event\|wait_event\|current_stream_idx" \
               "$src"/*.py "$src"/codegen/wrapper.py 2>&1 | tee "$OUT/probe_streams.txt" | head -20
             python3 -c "import torch; print('torch.ops.streams:', hasattr(torch.ops, 'streams') and [n for n in dir(torch.ops.streams) if not n.startswith('_')])" 2>&1 | tee -a "$OUT/probe_streams.txt"
             tar czf "$OUT/inductor_src.tgz" -C "$src/.." _inductor/graph.py _inductor/scheduler.py _inductor/ir.py \
               _inductor/lowering.py _inductor/codegen/wrapper.py $(cd "$src/.." && ls _inductor/stream*.py 2>/dev/null) ;;
    capture-wrappers) rm -rf /tmp/wr; for m in googlenet inception_v3 resnet50; do for p in fp32 bf16_cl; do
               timeout 540 python3 -m experiments.capture_wrappers --device cuda --models $m --precisions $p \
                 --out /tmp/wr > "$OUT/capture_${m}_$p.log" 2>&1 &
             done; done; wait; grep -h "wrote\|FAILED" "$OUT"/capture_*.log
             tar czf "$OUT/wrappers_cuda.tgz" -C /tmp/wr . ; tar czf "$OUT/capture_logs.tgz" -C "$OUT" $(cd "$OUT"; ls capture_*.log)
             rm -f "$OUT"/capture_*.log ;;
    wrappers) grep -rl --include=*.py "def call(" .cache/inductor 2>/dev/null | head -40 \
                | tar czf "$OUT/wrappers.tgz" -T - ;;
    zoo-giants) CUDA_VISIBLE_DEVICES= timeout 560 python3 -m pytest -q -p no:cacheprovider -m zoo_full \
                  tests/test_zoo.py -k "vit_h_14 or regnet_y_128gf" --durations=0 > "$OUT/zoo_giants.log" 2>&1 & ;;
    bench) python3 experiments/bench_train.py --repeats 20 --streams 2 4 8 --out "$OUT/bench_train.json" 2>&1 \
             | tee "$OUT/bench_train.log" | tail -30 ;;
    quick) python3 experiments/bench_train.py --models googlenet inception_v3 --batches 8 64 --repeats 20 \
             --out "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" | tail -20 ;;
    tuner) timeout 570 python3 experiments/gpu_tuner_report.py --out "$OUT" 2>&1 | tee "$OUT/gpu_tuner_report.log" | tail -40 ;;
    scaling) dir=experiments/results/${SWEEP_DIR%/*}/scaling
             timeout -k 5 $(( ${DEADLINE:-585} - SECONDS - 15 )) python3 -m experiments.scaling --out "$dir" --resume \
               2>&1 | tee -a "$OUT/scaling.log" | grep -v "^W1\|Warning" | tail -12
             tar czf "$OUT/scaling.tgz" --exclude=traces "$dir" ;;
    sweep:*) dir=experiments/results/$SWEEP_DIR; sweep_args=${step#sweep:}
             left=$(( ${DEADLINE:-585} - SECONDS - 15 ))  # stop in time to pack what finished
             timeout -k 5 $left python3 -m experiments.sweep --out "$dir" --resume ${sweep_args//,/ } 2>&1 \
               | tee -a "$OUT/sweep.log" | grep -v "^W1\|Warning" | tail -6
             pkill -f "experiments.sweep --(one|group)"  # children a timeout orphaned must not outlive the call
             tar czf "$OUT/sweep.tgz" --exclude=traces "$dir" ;;  # profiler traces stay behind (100+ MB)
    *) echo "unknown step $step" ;;
  esac
done
wait
echo "=== done ($(date +%T))"
