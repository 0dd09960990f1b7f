#!/usr/bin/env bash
# Out-of-memory errors and the step's share of phase switches on ONE GPU: a 7B policy with a 7B judge (Qwen2.5-7B shapes, random weights),
# full and partial colocation with Plan(offload="auto"), long-tail mix, forced lengths; counts
# out-of-memory errors and reports the share of phase switches + weight sync, with the memory
# timeline plot (step_memory_<gpu>.png) beside the step plot.
#
#   ONLY=smoke   bash bench/step/step_gpu_7b.sh   # full + partial, 1 warm-up + 2 steps: ~8 min
#   ONLY=full    bash bench/step/step_gpu_7b.sh   # full, 1 warm-up + STEPS (20) steps: one call
#   ONLY=partial bash bench/step/step_gpu_7b.sh   # partial, 1 warm-up + STEPS steps: one call
#   ONLY=15b     bash bench/step/step_gpu_7b.sh   # 1.5B + 1.5B full and partial, auto, 16k-token
#                                            # micro-batches: a crash once reported there
# Writes under $OUT (default /tmp/yatt-step7b-out): the report (md, json, both plots), device.txt
# and an archive of the per-run JSONs and logs (oom_*.json where a run ran out of memory).
#
# Runs on nvidia-h200: one H200 (143771 MiB, ~140 GiB) and 128 GiB of host RAM. The script uses
# GPU 0 only (CUDA_VISIBLE_DEVICES=0) and first prints the host-memory check below (HOST_CHECK=0
# skips it; it exits 3 when the plan cannot fit). The lent VMs' MemTotal starts low and grows as
# memory is used (~3 s per 8 GiB), so YATT_HOST_MEMORY_BYTES tells yatt's check (and this one)
# the 128 GiB limit: available = limit - in use.
#
# Memory plan, 7B policy + 7B judge (Qwen2.5-7B shapes: 7.62B parameters), with the options
# below: activation checkpointing, AdamW state on the host between optimizer steps, the
# micro-batch cap chosen from free memory, the rollout engine without a weights backup (the
# weight sync refills it after each wake). GiB; 128 samples of the long-tail mix; KV caches of
# 128 slots (rollout 1152 tokens, judge 1320; 56 KiB a token); auto's headroom 7 (5%).
#
#   phase               on the GPU (offload="auto": roles kept awake while the phase fits)     GPU
#   rollout             policy float32 weights 28.4 (kept) + engine bf16 14.2 + KV 7.9       ~52
#   genrm               the above + judge bf16 14.2 + KV 9.0 (all kept)                      ~74
#   train, fwd/bwd      engines asleep; weights 28.4 + grads 28.4 + bf16 casts 14.2
#                       + activations <= 61 (cap ~88k tokens at 0.69 MiB/token, chosen so)  <= 133
#   train, AdamW step   weights 28.4 + grads 28.4 + AdamW state 57.0 (in for the step)        114
#   sync                policy weights 28.4 + engine weights 14.2                             43
#   partial colocation: rollout/genrm phases hold both engines (28.4 + 16.9 KV) beside the
#   policy's weights (~74), train and sync as above. Peak 133 of 140: the cap leaves the margin.
#
#   host, pinned by the roles asleep (cached from their first sleep on)                    host
#   policy float32 weights, offload's power-of-two slabs                                    28.5
#   policy AdamW state (two moments + step counts)                                         57.0
#   judge weights backup (torch_memory_saver's retained pinned copy)                        14.2
#   rollout engine weights backup: none (BuiltinEngine(should_back_up_weights=False))       0
#   yatt's host headroom                                                                    4.0
#   total                                                                                   103.7
# of 128 GiB: ~24 GiB margin before the process's own memory (Python, CUDA, batches: ~5).
# Before the host-memory fixes it needed 190 GiB: torch's pinned allocator rounded each tensor
# up to a power of two (weights 53.9, AdamW 107.8) and both engines kept a backup (2 x 14.2).
# If it did not fit: bf16 AdamW moments would halve the 57 (not an option yet).
#
# Estimates (not measured yet): models made once ~1.5 min (2 x 15 GB written), each run loads
# for ~1 min (+ ~40 s the first time the VM grows its RAM for 100 GiB of pinned copies), then
# ~25-35 s per 7B step (decode of the 1024-token tail dominates the rollout).
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
source "$(dirname "$0")/../../gpu_checks/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export CUDA_VISIBLE_DEVICES=0
export YATT_HOST_MEMORY_BYTES=${YATT_HOST_MEMORY_BYTES:-$((128 << 30))}  # nvidia-h200's limit
free -g | tee -a "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"

# What the roles will pin on the host, from the shapes (no model made), against the host: the
# same numbers yatt's Plan checks at its first switch, here before anything loads.
if [[ ${HOST_CHECK:-1} == 1 ]]; then
  python3 - <<'PY' 2>&1 | tee -a "$OUT/device.txt" || exit 3
import sys

sys.path.insert(0, "bench/step")
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import _step_setup as setup
from yatt.placement import pinned_host_bytes, read_host_available_bytes

GIB = 2**30
with torch.device("meta"):  # nothing allocated
    model = AutoModelForCausalLM.from_config(Qwen2Config(**setup.shape_config("7b")))
sizes = [4 * p.numel() for p in model.parameters()]  # float32, as TorchPolicy trains
parts = {
    "policy float32 weights": pinned_host_bytes(sizes),
    "policy AdamW state": pinned_host_bytes(sizes * 2 + [4] * len(sizes)),
    "judge weights backup (bf16)": sum(sizes) // 2,
    "rollout engine weights backup": 0,
    "yatt host headroom": 4 * GIB,
}
need, available = sum(parts.values()), read_host_available_bytes()
for name, num_bytes in parts.items():
    print(f"host check: {name:32s} {num_bytes / GIB:6.1f} GiB")
print(f"host check: need {need / GIB:.1f} GiB, available {available / GIB:.1f} GiB")
if need > available:
    sys.exit("host check: does not fit; see the memory plan at the top of bench/step/step_gpu_7b.sh")
PY
fi

START=$SECONDS
source "$(dirname "$0")/_step_run.sh"  # run NAME CMD...

# 7B on one GPU: activation checkpointing, AdamW's state on the host except for its step, the
# micro-batch cap chosen from free memory, no per-step checkpoint (91 GB of state).
BIG="--shape 7b --offload auto --mix longtail --warmup 1 --activation-checkpointing"
BIG="$BIG --offload-optimizer --micro-batch-tokens auto --no-ckpt"
STEP7="bench/step/step.py --model-dir /tmp/yatt-step-7b --out-dir $RUNS $BIG"
STEP15="bench/step/step.py --model-dir /tmp/yatt-step-15b --out-dir $RUNS --shape 1.5b --offload auto"
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

# The out-of-memory bar counts every out-of-memory error: an oom_*.json per run that hit one, and any
# log line of one (a crash outside the step loop writes no JSON).
echo "oom records: $(ls "$RUNS"/oom_*.json 2>/dev/null | wc -l)" | tee -a "$OUT/device.txt"
echo "oom log lines: $(cat "$RUNS"/*.log | grep -ci 'out of memory')" | tee -a "$OUT/device.txt"
python3 bench/step/step.py --report --results-dir "$RUNS" 2>&1 | tee "$OUT/report.log" | tail -n 40
cp "$RUNS"/step_nvidia_* "$RUNS"/step_memory_* "$RUNS"/step_cuda.* "$OUT"/ 2>/dev/null
tar -czf "$OUT/step7b_runs.tar.gz" -C "$RUNS" .
echo "total $((SECONDS - START))s"
