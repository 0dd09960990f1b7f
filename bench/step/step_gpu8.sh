#!/usr/bin/env bash
# The placement matrix on one 8-GPU host (bench/step/step.py), one run after another, then
# the report (carry .whl as for bench/step/step_gpu.sh: there is no network on the device machine):
#   bash bench/step/step_gpu8.sh                 # writes under $OUT (default /tmp/yatt-step8-out)
# Runs (Qwen2.5-1.5B-shaped policy and judge, random weights; PPR=64 prompts per GPU x 8
# samples, so every layout does the same 8 x 64 prompts a step; fixed and longtail mixes;
# WARMUP=2 + STEPS=5 timed steps each):
#   full       (a) 8 ranks, full colocation
#   partial    (b) 8 ranks, partial colocation
#   ded62      (c) 6 policy ranks (GPUs 0-5) + a judge pool of 2 servers (GPUs 6, 7)
#   ded44      (c') 4 policy ranks (GPUs 0-3) + 4 judge servers (GPUs 4-7)
# then `bench/step/step.py --report`: (a)/(c) <= 0.5, (a)/(c') reported, (b)/(a) rollout+GenRM <=
# 0.80 at 8 GPUs, per-GPU busy fraction and peak memory (the judge GPUs' too), the plot.
#
# GPUS=2: the same code paths on a 2-GPU host, as a smoke test before the 8-GPU run (0.5B
# shapes, 16 prompts by default; SHAPE=1.5b PPR=8 tries the 1.5B shape there):
#   full2      full colocation, 2 ranks
#   ded11      1 policy rank through torchrun + the pool of one (--judge-gpus 1)
#   ded1s2     1 policy rank + 2 judge servers sharing GPU 1 (--judge-gpus 1,1): the client
#              spreads over 2 servers; the JSON's judge_pool shows what each one judged
#
# ONLY=ded62,ded44 picks runs by name. A run of the 8-GPU matrix takes several minutes (about
# 14 steps of 512 samples per GPU): on the lent device, one run per 10-minute call, e.g.
#   ONLY=full RUN_TIMEOUT=540 bash bench/step/step_gpu8.sh
# each call's per-run JSON comes back in $OUT/step_runs.tar.gz; unpack them all into one folder
# and run `python3 bench/step/step.py --report --results-dir DIR` anywhere (CPU is fine): ratios
# between runs of different calls are flagged "runs on different hosts".
set -uo pipefail
OUT=${OUT:-/tmp/yatt-step8-out}
GPUS=${GPUS:-8}
RUN_TIMEOUT=${RUN_TIMEOUT:-1200}
BUDGET_S=${BUDGET_S:-100000}  # no run starts later than this (seconds into the script)
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
MIX=${MIX:-fixed,longtail}
EXTRA=${STEP_EXTRA:-}  # every run: e.g. "--tiny --steps 1" for a CPU dry run of the script
RUNS=${RUNS:-/tmp/yatt-step8-runs}  # per-run JSONs and logs; they come back as one archive
if [[ $GPUS == 8 ]]; then
  SHAPE=${SHAPE:-1.5b}
  PPR=${PPR:-64}
  MODELS=${MODELS:-/tmp/yatt-step-1.5b}
else
  SHAPE=${SHAPE:-0.5b}
  PPR=${PPR:-}
  MODELS=${MODELS:-/tmp/yatt-step}
fi
rm -rf "$RUNS"
mkdir -p "$OUT" "$RUNS"
source "$(dirname "$0")/../../gpu_checks/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"
df -h /dev/shm /tmp | tee -a "$OUT/device.txt"

START=$SECONDS
WORK="--shape $SHAPE --steps $STEPS --warmup $WARMUP --mix $MIX"
[[ -n $PPR ]] && WORK+=" --prompts-per-rank $PPR"
STEP="bench/step/step.py --model-dir $MODELS --out-dir $RUNS $WORK $EXTRA"
# $TORCHRUN N ...: N ranks on GPUs 0..N-1 (each rank's LOCAL_RANK), this host only.
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node"

source "$(dirname "$0")/_step_run.sh"  # run NAME CMD...
ONLY=${ONLY:-all}
want() { [[ $ONLY == all || ",$ONLY," == *",$1,"* ]]; }

# Models once (random weights, saved with save_pretrained), reused by every run.
run models python3 $STEP --prepare

# Every run has the host to itself (the report refuses ratios between runs that overlapped).
if [[ $GPUS == 8 ]]; then
  want full && run full $TORCHRUN 8 $STEP --layout full
  want partial && run partial $TORCHRUN 8 $STEP --layout partial
  want ded62 && run ded62 $TORCHRUN 6 $STEP --layout dedicated --judge-gpus 6,7
  want ded44 && run ded44 $TORCHRUN 4 $STEP --layout dedicated --judge-gpus 4,5,6,7
else
  want full2 && run full2 $TORCHRUN 2 $STEP --layout full
  want ded11 && run ded11 $TORCHRUN 1 $STEP --layout dedicated --judge-gpus 1
  want ded1s2 && run ded1s2 $TORCHRUN 1 $STEP --layout dedicated --judge-gpus 1,1
fi

python3 bench/step/step.py --report --results-dir "$RUNS" 2>&1 | tee "$OUT/report.log" | tail -n 40
cp "$RUNS"/step_nvidia_* "$RUNS"/step_cuda.* "$RUNS"/step_cpu.* "$OUT"/ 2>/dev/null
# Only a few files come back from $OUT: the per-run JSONs and logs travel in one archive.
tar -czf "$OUT/step_runs.tar.gz" -C "$RUNS" .
echo "total $((SECONDS - START))s"
