#!/usr/bin/env bash
# The GRPO step by placement (bench/step/step.py) on the device machine (carry .whl: trl, datasets, dill,
# multiprocess and torch_memory_saver come as wheels; there is no network there):
#   ONLY=1gpu bash bench/step/step_gpu.sh   # writes under $OUT (default /tmp/yatt-step-out)
# ONLY picks groups of runs, or single runs by name, comma-separated; each group fits one
# 10-minute device call at the defaults (2 warm-up + 5 timed steps per mix):
#   1gpu       full, TRL, partial          (yatt/TRL and (b)/(a) on 1 GPU)
#   1gpu-auto  full-auto, partial-auto, separate
#   2gpu       full, partial, dedicated    ((a)/(c), (b)/(a) on 2 GPUs; the train phase's
#                                           2-GPU/1-GPU ratio wants full_1gpu in the same call)
#   2gpu-auto  full-auto, dedicated-auto
#   scale      full and dedicated at 64 prompts, fixed mix, offload auto
#   seed       dynamic sampling's bars, 1 GPU, the seed mix (0.5B policy, 1.5B judge writing 384
#              tokens, half the groups without reward variance), offload auto: full and
#              partial with the new sampler, partial with --fill-probability 0.9 ("-fill0.9"),
#              then full and partial with the round-based one ("-old"); single runs by name
#              (e.g. ONLY=seed_models,seed_partial_fill90_1gpu) where one call is too short
#   seed-keep  partial, cut groups resumed next step (--keep-partial)
#   all        every group but scale and seed (longer than one call)
# Every run has the host to itself: runs go one after another, 1-GPU runs on GPU 0 (the
# report refuses ratios between runs whose wall-clock intervals overlapped on one host). Each
# run has its own timeout, and runs that would start after BUDGET_S seconds are skipped; the
# report marks what was not measured.
set -uo pipefail
OUT=${OUT:-/tmp/yatt-step-out}
BUDGET_S=${BUDGET_S:-360}  # no run starts later; + RUN_TIMEOUT = worst case
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
EXTRA=${STEP_EXTRA:-}  # every run, TRL's too: e.g. "--tiny --steps 1" for a CPU dry run
YATT_EXTRA=${YATT_EXTRA:-}  # yatt's runs only: e.g. "--profile-phase train"
RUNS=${RUNS:-/tmp/yatt-step-runs}  # per-run JSONs and logs; they come back as one archive
rm -rf "$RUNS"
mkdir -p "$OUT" "$RUNS"
source "$(dirname "$0")/../../gpu_checks/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"
df -h /dev/shm /tmp | tee -a "$OUT/device.txt"

START=$SECONDS
MODELS=/tmp/yatt-step
STEP="bench/step/step.py --model-dir $MODELS --out-dir $RUNS $EXTRA $YATT_EXTRA"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2"

source "$(dirname "$0")/_step_run.sh"  # run NAME CMD...

ONLY=${ONLY:-all}
# Models once (random weights, saved with save_pretrained), reused by every run; the seed
# mix has its own (a 1.5B judge).
[[ ",$ONLY," =~ ^(,seed[a-z0-9_-]*)+,$ ]] || run models python3 $STEP --prepare
# want NAME GROUP...: whether ONLY names this run or one of its groups.
want() {
  local name=$1; shift
  local g
  for g in "$name" "$@"; do
    [[ ",$ONLY," == *",$g,"* ]] && return 0
  done
  return 1
}

# Each yatt layout runs as the seed had it (offload at every switch: the bars' setting) and
# with Plan(offload="auto") (a role sleeps only when the next phase would not fit).
want full_2gpu 2gpu all && run full_2gpu $TORCHRUN $STEP --layout full
want partial_2gpu 2gpu all && run partial_2gpu $TORCHRUN $STEP --layout partial
want dedicated_2gpu 2gpu all && run dedicated_2gpu python3 $STEP --layout dedicated --judge-gpu 1
want full_auto_2gpu 2gpu-auto all && run full_auto_2gpu $TORCHRUN $STEP --layout full --offload auto
want dedicated_auto_2gpu 2gpu-auto all && \
  run dedicated_auto_2gpu python3 $STEP --layout dedicated --judge-gpu 1 --offload auto

# 1-GPU runs, one after another on GPU 0: two at once on one host (one per GPU) share its
# CPUs and memory bandwidth, and their times are compared with each other.
export CUDA_VISIBLE_DEVICES=0
want full_1gpu 1gpu all && run full_1gpu python3 $STEP --layout full
# TRL: as many steps as ours (its own defaults are 1 + 3); $EXTRA still overrides them.
want trl_1gpu 1gpu all && run trl_1gpu python3 bench/step/step_trl.py --warmup 2 --steps 5 \
  --model-dir $MODELS --out-dir "$RUNS" $EXTRA
want partial_1gpu 1gpu all && run partial_1gpu python3 $STEP --layout partial
want full_auto_1gpu 1gpu-auto all && run full_auto_1gpu python3 $STEP --layout full --offload auto
want partial_auto_1gpu 1gpu-auto all && \
  run partial_auto_1gpu python3 $STEP --layout partial --offload auto
want separate_1gpu 1gpu-auto all && run separate_1gpu python3 $STEP --layout dedicated

# The seed mix (dynamic sampling): SEED_STEPS timed steps after one warm-up each (offload auto has no
# first offload of AdamW's state to warm up for).
SEED="$STEP --mix seed --offload auto --model-dir /tmp/yatt-step-seed --warmup 1 --steps ${SEED_STEPS:-3}"
if want seed_models seed seed-keep; then run seed_models python3 $SEED --prepare; fi
# The new sampler's full run warmed up in 120 s on an H200 (likely, not confirmed: a decode
# graph per batch size its draws hit): at least 240 s, whatever RUN_TIMEOUT says.
want seed_full_1gpu seed && \
  RUN_TIMEOUT=$(( RUN_TIMEOUT > 240 ? RUN_TIMEOUT : 240 )) run seed_full_1gpu python3 $SEED --layout full
want seed_partial_1gpu seed && run seed_partial_1gpu python3 $SEED --layout partial
# The stream keeping in flight the groups that fill the batch with probability 0.9 (not the
# expected number): it over-samples, and the abort cuts the long tail ("-fill0.9").
want seed_partial_fill90_1gpu seed && \
  run seed_partial_fill90_1gpu python3 $SEED --layout partial --fill-probability 0.9
# SEED_JUDGE_WINDOW=<ms>: also partial with the judge's streamed batches held that long
# (--judge-batch-window-ms; fewer, larger judge calls: "-jw<ms>").
if [ -n "${SEED_JUDGE_WINDOW:-}" ]; then
  want seed_partial_jw_1gpu seed && run seed_partial_jw_1gpu python3 $SEED --layout partial \
    --judge-batch-window-ms "$SEED_JUDGE_WINDOW"
fi
want seed_full_old_1gpu seed && run seed_full_old_1gpu python3 $SEED --layout full --sampler old
want seed_partial_old_1gpu seed && \
  run seed_partial_old_1gpu python3 $SEED --layout partial --sampler old
want seed_partial_keep_1gpu seed-keep && \
  run seed_partial_keep_1gpu python3 $SEED --layout partial --keep-partial
unset CUDA_VISIBLE_DEVICES

# A 4x larger batch on 2 GPUs: does (a)/(c) move toward 0.5 once the GPUs have more work?
want scale && run full_p64_2gpu $TORCHRUN $STEP --layout full --offload auto --prompts 64 --mix fixed
want scale && run dedicated_p64_2gpu python3 $STEP --layout dedicated --judge-gpu 1 --offload auto --prompts 64 --mix fixed

python3 bench/step/step.py --report --results-dir "$RUNS" 2>&1 | tee "$OUT/report.log" | tail -n 30
cp "$RUNS"/step_nvidia_* "$RUNS"/step_cuda.* "$OUT"/ 2>/dev/null
# Only 8 files come back from $OUT: the per-run JSONs and logs travel in one archive.
tar -czf "$OUT/step_runs.tar.gz" -C "$RUNS" .
echo "total $((SECONDS - START))s"
