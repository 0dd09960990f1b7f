#!/usr/bin/env bash
# Issue 27's bars on ONE GPU: a 7B policy with a 7B judge (Qwen2.5-7B shapes, random weights),
# full and partial colocation with Plan(offload="auto"), long-tail mix, forced lengths; counts
# out-of-memory errors and reports the share of phase switches + weight sync, with the memory
# timeline plot (step_memory_<gpu>.png) beside the step plot.
#
#   ONLY=smoke   bash bench/step_gpu_7b.sh   # full + partial, 1 warm-up + 2 steps: ~8 min
#   ONLY=full    bash bench/step_gpu_7b.sh   # full, 1 warm-up + STEPS (20) steps: one call
#   ONLY=partial bash bench/step_gpu_7b.sh   # partial, 1 warm-up + STEPS steps: one call
#   ONLY=15b     bash bench/step_gpu_7b.sh   # 1.5B + 1.5B full and partial, auto, 16k-token
#                                            # micro-batches: the crash the issue reports
# Writes under $OUT (default /tmp/yatt-step7b-out): the report (md, json, both plots), device.txt
# and an archive of the per-run JSONs and logs (oom_*.json where a run ran out of memory).
#
# Host memory: the trainer's pinned copies (7.6B float32 weights 30 GB + AdamW state 61 GB) and
# the engines' retained weight backups (2 x 15 GB) need ~125 GB of pinned host RAM: run on
# nvidia-h200-x2 (256 GiB host RAM); the script uses its GPU 0 only (CUDA_VISIBLE_DEVICES=0).
# Estimates (not measured yet): models made once ~1.5 min (2 x 15 GB written), each run loads
# for ~1 min, then ~25-35 s per 7B step (decode of the 1024-token tail dominates the rollout).
set -uo pipefail
OUT=${OUT:-/tmp/yatt-step7b-out}
STEPS=${STEPS:-20}
ONLY=${ONLY:-smoke}
BUDGET_S=${BUDGET_S:-540}  # no run starts later
# One run per 10-minute device call, or the two smoke runs in one.
if [[ $ONLY == smoke ]]; then RUN_TIMEOUT=${RUN_TIMEOUT:-230}; else RUN_TIMEOUT=${RUN_TIMEOUT:-560}; fi
RUNS=${RUNS:-/tmp/yatt-step7b-runs}
rm -rf "$RUNS"
mkdir -p "$OUT" "$RUNS"
source "$(dirname "$0")/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export CUDA_VISIBLE_DEVICES=0
free -g | tee -a "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"

START=$SECONDS
source "$(dirname "$0")/_step_run.sh"  # run NAME CMD...

# 7B on one GPU: activation checkpointing, AdamW's state on the host except for its step, the
# micro-batch cap chosen from free memory, no per-step checkpoint (91 GB of state).
BIG="--shape 7b --offload auto --mix longtail --warmup 1 --activation-checkpointing"
BIG="$BIG --offload-optimizer --micro-batch-tokens auto --no-ckpt"
STEP7="bench/step.py --model-dir /tmp/yatt-step-7b --out-dir $RUNS $BIG"
STEP15="bench/step.py --model-dir /tmp/yatt-step-15b --out-dir $RUNS --shape 1.5b --offload auto"
STEP15="$STEP15 --mix longtail --warmup 1 --steps 5 --micro-batch-tokens 16384"

case ",$ONLY," in
  *,smoke,*|*,full,*|*,partial,*) run models_7b python3 $STEP7 --prepare ;;
esac
case ",$ONLY," in *,15b,*) run models_15b python3 $STEP15 --prepare ;; esac

case ",$ONLY," in
  *,smoke,*)
    run full_auto_7b python3 $STEP7 --layout full --steps 2
    run partial_auto_7b python3 $STEP7 --layout partial --steps 2 ;;
esac
case ",$ONLY," in *,full,*) run full_auto_7b python3 $STEP7 --layout full --steps "$STEPS" ;; esac
case ",$ONLY," in
  *,partial,*) run partial_auto_7b python3 $STEP7 --layout partial --steps "$STEPS" ;;
esac
case ",$ONLY," in
  *,15b,*)
    run full_auto_15b python3 $STEP15 --layout full
    run partial_auto_15b python3 $STEP15 --layout partial ;;
esac

# The issue's bar counts every out-of-memory error: an oom_*.json per run that hit one, and any
# log line of one (a crash outside the step loop writes no JSON).
echo "oom records: $(ls "$RUNS"/oom_*.json 2>/dev/null | wc -l)" | tee -a "$OUT/device.txt"
echo "oom log lines: $(cat "$RUNS"/*.log | grep -ci 'out of memory')" | tee -a "$OUT/device.txt"
python3 bench/step.py --report --results-dir "$RUNS" 2>&1 | tee "$OUT/report.log" | tail -n 40
cp "$RUNS"/step_nvidia_* "$RUNS"/step_memory_* "$RUNS"/step_cuda.* "$OUT"/ 2>/dev/null
tar -czf "$OUT/step7b_runs.tar.gz" -C "$RUNS" .
echo "total $((SECONDS - START))s"
