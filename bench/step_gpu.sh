#!/usr/bin/env bash
# Issue #8's placement benchmark on a 2-GPU machine, in one command (carry .whl: trl, datasets,
# dill, multiprocess and torch_memory_saver come as wheels; there is no network there):
#   bash bench/step_gpu.sh            # writes under $OUT (default /tmp/yatt-step-out)
# Order: 2-GPU runs first (the issue's first bar), then the 1-GPU runs two at a time, one per
# GPU (full || TRL, full-auto || partial-auto, partial || separate), then the report. Each run has its own timeout, and
# runs that would start after BUDGET_S seconds are skipped, so the whole script stays under
# about 8 minutes; the report marks what was not measured.
set -uo pipefail
OUT=${OUT:-/tmp/yatt-step-out}
BUDGET_S=${BUDGET_S:-330}  # no run starts later; + RUN_TIMEOUT = worst case
RUN_TIMEOUT=${RUN_TIMEOUT:-130}
EXTRA=${STEP_EXTRA:-}  # every run, TRL's too: e.g. "--tiny --steps 1" for a CPU dry run
YATT_EXTRA=${YATT_EXTRA:-}  # yatt's runs only: e.g. "--profile-phase train"
RUNS=${RUNS:-/tmp/yatt-step-runs}  # per-run JSONs and logs; they come back as one archive
rm -rf "$RUNS"
mkdir -p "$OUT" "$RUNS"
source "$(dirname "$0")/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"
df -h /dev/shm /tmp | tee -a "$OUT/device.txt"

START=$SECONDS
MODELS=/tmp/yatt-step
STEP="bench/step.py --model-dir $MODELS --out-dir $RUNS $EXTRA $YATT_EXTRA"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2"

# One run: name, then the command; logs to $RUNS/<name>.log, progress lines echoed.
run() {
  local name=$1; shift
  if (( SECONDS - START > BUDGET_S )); then
    echo "=== $name SKIPPED: past the ${BUDGET_S}s budget"; return
  fi
  local t0=$SECONDS
  echo "=== $name start at $((SECONDS - START))s"
  timeout -k 10 "$RUN_TIMEOUT" "$@" >"$RUNS/$name.log" 2>&1
  local rc=$?
  grep -E "^\[|wrote|Error|error" "$RUNS/$name.log" | grep -v "Warning" | tail -n 14
  echo "=== $name rc=$rc $((SECONDS - t0))s"
}

# Models once (random weights, saved with save_pretrained), reused by every run.
run models python3 $STEP --prepare

# ONLY=2gpu|1gpu|scale runs one part (the whole set takes longer than one 10-minute device call).
# Each yatt layout runs as the seed had it (offload at every switch: the bars' setting) and
# with Plan(offload="auto") (a role sleeps only when the next phase would not fit).
ONLY=${ONLY:-all}
if [ "$ONLY" = all ] || [ "$ONLY" = 2gpu ]; then
  run full_2gpu $TORCHRUN $STEP --layout full
  run dedicated_2gpu python3 $STEP --layout dedicated --judge-gpu 1
  run partial_2gpu $TORCHRUN $STEP --layout partial
  run full_auto_2gpu $TORCHRUN $STEP --layout full --offload auto
  run dedicated_auto_2gpu python3 $STEP --layout dedicated --judge-gpu 1 --offload auto
fi

# 1-GPU runs, two at a time on different GPUs (each its own process and GPU).
if [ "$ONLY" = all ] || [ "$ONLY" = 1gpu ]; then
  CUDA_VISIBLE_DEVICES=0 run full_1gpu python3 $STEP --layout full &
  CUDA_VISIBLE_DEVICES=1 run trl_1gpu python3 bench/step_trl.py --model-dir $MODELS --out-dir "$RUNS" $EXTRA &
  wait
  CUDA_VISIBLE_DEVICES=0 run full_auto_1gpu python3 $STEP --layout full --offload auto &
  CUDA_VISIBLE_DEVICES=1 run partial_auto_1gpu python3 $STEP --layout partial --offload auto &
  wait
  CUDA_VISIBLE_DEVICES=0 run partial_1gpu python3 $STEP --layout partial &
  CUDA_VISIBLE_DEVICES=1 run separate_1gpu python3 $STEP --layout dedicated &
  wait
fi

# A 4x larger batch on 2 GPUs: does (a)/(c) move toward 0.5 once the GPUs have more work?
if [ "$ONLY" = scale ]; then
  run full_p64_2gpu $TORCHRUN $STEP --layout full --offload auto --prompts 64 --mix fixed
  run dedicated_p64_2gpu python3 $STEP --layout dedicated --judge-gpu 1 --offload auto --prompts 64 --mix fixed
fi

python3 bench/step.py --report --results-dir "$RUNS" 2>&1 | tee "$OUT/report.log" | tail -n 30
cp "$RUNS"/step_nvidia_* "$RUNS"/step_cuda.* "$OUT"/ 2>/dev/null
# Only 8 files come back from $OUT: the per-run JSONs and logs travel in one archive.
tar -czf "$OUT/step_runs.tar.gz" -C "$RUNS" .
echo "total $((SECONDS - START))s"
