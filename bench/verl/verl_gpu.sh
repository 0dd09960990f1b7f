#!/usr/bin/env bash
# verl and TRL + vLLM beside yatt on one GPU, one step per argument:
#   bash bench/verl/verl_gpu.sh stash                        # a carried piece -> /root/wheels
#   bash bench/verl/verl_gpu.sh unpack probe                 # sites in place, imports and Ray checked
#   bash bench/verl/verl_gpu.sh models verl_longtail         # one verl run (~9 min cold: background.sh)
#   bash bench/verl/verl_gpu.sh yatt trl_vllm report         # yatt's and TRL's runs, then the table
#
# Packages: the machine has no registry. vLLM 0.26.0 (scripts/pack_engine_site.sh vllm) and verl
# 0.9.1 with Ray 2.54.1, transformers 5.9.0 and the rest (scripts/pack_verl_site.sh) travel as xz
# pieces of <= 56 MiB, one device call each: `stash` copies the pieces carried in $PACKS (default
# .packs, an ignored folder named in the call's carry) to /root/wheels, where they stay while
# the machine is held; `unpack` joins them into /root/site_vllm and /root/site_verl. trl,
# datasets, dill, multiprocess and torch_memory_saver come as .whl/ wheels (gpu_checks/_gpu_env.sh).
# Each framework runs in its own process with its own path: verl with site_verl then site_vllm
# first (verl wants transformers < 5.11: site_verl's 5.9.0 hides the image's 5.17), TRL and
# yatt's vLLM runs with site_vllm only (the image's transformers).
#
# Runs (JSON per run) are kept in $RUNS_DIR (default /root/verl-runs, outside $OUT, which each
# call empties) so that `report` in a later call of the same held machine merges them all; every
# step copies what it made to $OUT as one archive (a call returns at most 8 files).
#   VERL_RUNS   verl runs of step verl_runs, MIX[:1.5b][:recompute][:fused|:fusedtorch][:poll] each (default
#               longtail,fixed), e.g. "longtail:fusedtorch,longtail:1.5b:fusedtorch"; one run is
#               also a step of its own: verl_longtail:fusedtorch. fused = verl's Triton log-prob
#               head, which fails without remove-padding (flash-attn) in verl 0.9.1's engine
#               worker; fusedtorch = its chunked torch head, which works on padded batches;
#               poll = the V1 trainer's replay buffer polling every 0.05 s instead of 2.0 s
#   YATT_OFFLOAD  yatt's --offload (default auto: a role sleeps only when the next phase would not
#               fit, as TRL keeps its engines resident; "always" sleeps every role at each switch)
#   YATT_1P5B_LAYOUTS  layouts of step yatt_1.5b, the 1.5B judge on the longtail mix (full,partial)
#   YATT_RUNS   yatt runs of step yatt: "layout:backend" pairs (default full:builtin,
#               partial:builtin,full:vllm), each with --judge-tokens 128 --no-ckpt, YATT_MIX
#               (default fixed,longtail)
#   STEPS/WARMUP  timed and warm-up steps of every run (default 5 and 2)
set -uo pipefail
OUT=${OUT:-/tmp/verl-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/../../gpu_checks/_gpu_env.sh"  # .whl wheels, PYTHONPATH, NCCL settings, device.txt, run_step
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 NVSHMEM_DISABLE_NVLS=1 RAY_DEDUP_LOGS=0
PACKS=${PACKS:-.packs}
PIECES=${PIECES:-/root/wheels}
RUNS_DIR=${RUNS_DIR:-/root/verl-runs}
MODELS=${MODELS:-/tmp/yatt-step}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
# One verl run: Ray + FSDP + two vLLM servers start (~7.5 min on a cold machine, session 14), then
# 7 steps. Longer than one device call: run it under gpu_checks/background.sh.
STEP_TIMEOUT=${STEP_TIMEOUT:-760}
mkdir -p "$PIECES" "$RUNS_DIR"
# trl (a carried wheel) lives apart from /tmp/site: verl's FSDP workers import trl's value-head
# model whenever trl is importable, and trl 1.16 moved it (the first verl run on the H200 failed
# there: "cannot import name 'AutoModelForCausalLMWithValueHead' from 'trl'").
if [ -d /tmp/site/trl ]; then
  mkdir -p /tmp/site_trl && rm -rf /tmp/site_trl/trl* && mv /tmp/site/trl /tmp/site/trl-*.dist-info /tmp/site_trl/
fi
BASE_PATH=$PYTHONPATH
VERL_PATH="/root/site_verl:/root/site_vllm:$BASE_PATH"
VLLM_PATH="/root/site_vllm:$BASE_PATH"
TRL_PATH="/tmp/site_trl:$VLLM_PATH"

stash() {
  ls "$PACKS"/*.part-* >/dev/null 2>&1 || { echo "no pieces in $PACKS"; return 1; }
  cp -v "$PACKS"/*.part-* "$PIECES"/
  ls -la "$PIECES"
}

unpack() {
  for name in vllm verl sgl; do
    [ -d "/root/site_$name" ] && continue
    ls "$PIECES/${name}_site.tar.xz.part-"* >/dev/null 2>&1 || { echo "no pieces for $name"; continue; }
    cat "$PIECES/${name}_site.tar.xz.part-"* | python3 -c \
      "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root')"
    du -sh "/root/site_$name"
  done
}

probe() {  # imports, unmet requirements, a Ray cluster, and verl's own check of the config
  PYTHONPATH=$VERL_PATH python3 bench/_common/probe_site.py \
    --modules verl,ray,vllm,transformers,tensordict,hydra,torchdata,codetiming,verl.trainer.main_ppo,verl.workers.rollout.vllm_rollout.vllm_async_server,verl.experimental.reward_loop.reward_loop,verl.workers.engine_workers,transfer_queue,verl.trainer.ppo.v1 \
    --dists verl,vllm,transformers,datasets,ray,transferqueue,tensordict,hydra-core
  PYTHONPATH=$VERL_PATH python3 - <<'EOF'
import time, ray
t0 = time.time()
ray.init(include_dashboard=False)
@ray.remote(num_gpus=0.5)
def where():
    import torch
    return torch.cuda.get_device_name(0)
print("ray ok", ray.get([where.remote(), where.remote()]), f"{time.time() - t0:.1f}s")
ray.shutdown()
EOF
  PYTHONPATH=$VERL_PATH python3 bench/verl/verl_step.py --dry-run --mix longtail \
    --model-dir /tmp/verl-dry-models --out-dir /tmp/verl-dry
  PYTHONPATH=bench/verl:$VERL_PATH python3 -c "import verl_plugins; print('plugins import ok')"
}

verl_run() {  # verl_run MIX[:1.5b][:recompute][:fused|:fusedtorch][:poll], e.g. longtail:fusedtorch:poll
  local spec=$1 mix=${1%%:*} extra=() models=$MODELS variant=verl_${1%%:*} mod
  IFS=: read -r -a mods <<<"${spec#"$mix"}"
  # in the order of verl_step.py's variant name: the judge, recompute, fused, poll
  local known=(1.5b recompute fused fusedtorch poll)
  for mod in "${mods[@]}"; do
    [[ -z $mod || " ${known[*]} " == *" $mod "* ]] && continue
    echo "verl_run: unknown modifier $mod in $spec"; return 1
  done
  for mod in "${known[@]}"; do
    [[ " ${mods[*]} " == *" $mod "* ]] || continue
    case $mod in
      1.5b) extra+=(--judge-shape 1.5b); models=$MODELS-0.5b-1.5b; variant+=-j1.5b ;;
      recompute) extra+=(--old-log-prob recompute); variant+=-recompute ;;
      fused) extra+=(--fused-kernels triton); variant+=-fused-triton ;;
      fusedtorch) extra+=(--fused-kernels torch); variant+=-fused-torch ;;
      poll) extra+=(--poll-interval-s 0.05); variant+=-poll50ms ;;
    esac
  done
  run_step "verl_${spec//:/_}" env PYTHONPATH="$VERL_PATH" python3 bench/verl/verl_step.py \
    --mix "$mix" "${extra[@]}" --steps "$STEPS" --warmup "$WARMUP" --judge-tokens 128 \
    --model-dir "$models" --out-dir "$RUNS_DIR" --timeout $((STEP_TIMEOUT - 30))
  # The Ray cluster this run started, if anything of it is left (it holds GPU memory)
  PYTHONPATH=$VERL_PATH python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
  # verl's own log and metrics, for a failed run too
  cp "$RUNS_DIR/${variant}_work/verl.log" "$OUT/${variant}_verl.log" 2>/dev/null
}

for step in "$@"; do
  case $step in
    stash) stash ;;
    unpack) unpack ;;
    probe) probe 2>&1 | tee "$OUT/probe.log" | grep -v "^$" | tail -n 60 ;;
    models)
      # bench/step/step.py's random-weight models, saved once (the image's transformers)
      python3 bench/step/step.py --prepare --model-dir "$MODELS"
      python3 bench/step/step.py --prepare --judge-shape 1.5b --model-dir "$MODELS-0.5b-1.5b" ;;
    verl_runs)
      IFS=, read -r -a specs <<<"${VERL_RUNS:-longtail,fixed}"
      for spec in "${specs[@]}"; do verl_run "$spec"; done ;;
    verl_*) verl_run "${step#verl_}" ;;
    yatt)
      IFS=, read -r -a pairs <<<"${YATT_RUNS:-full:builtin,partial:builtin,full:vllm}"
      for pair in "${pairs[@]}"; do
        layout=${pair%%:*}; backend=${pair##*:}; path=$BASE_PATH
        [ "$backend" = vllm ] && path=$VLLM_PATH
        run_step "yatt_${layout}_$backend" env PYTHONPATH="$path" python3 bench/step/step.py \
          --layout "$layout" --rollout-backend "$backend" --judge-tokens 128 --no-ckpt \
          --offload "${YATT_OFFLOAD:-auto}" \
          --mix "${YATT_MIX:-fixed,longtail}" --steps "$STEPS" --warmup "$WARMUP" \
          --model-dir "$MODELS" --out-dir "$RUNS_DIR"
      done ;;
    yatt_1.5b)
      # the 1.5B judge: both placements (the report takes the faster, as for the 0.5B judge)
      IFS=, read -r -a layouts <<<"${YATT_1P5B_LAYOUTS:-full,partial}"
      for layout in "${layouts[@]}"; do
        run_step "yatt_${layout}_builtin_1.5b" python3 bench/step/step.py --layout "$layout" \
          --judge-shape 1.5b --judge-tokens 128 --no-ckpt --mix longtail --steps "$STEPS" \
          --offload "${YATT_OFFLOAD:-auto}" \
          --warmup "$WARMUP" --model-dir "$MODELS-0.5b-1.5b" --out-dir "$RUNS_DIR"
      done ;;
    trl_vllm)
      run_step trl_vllm env PYTHONPATH="$TRL_PATH" python3 bench/step/step_trl.py --use-vllm \
        --judge-tokens 128 --steps "$STEPS" --warmup "$WARMUP" \
        --model-dir "$MODELS" --out-dir "$RUNS_DIR" ;;
    report)
      python3 bench/verl/verl_report.py --results-dir "$RUNS_DIR" --out-dir "$OUT" \
        --commit "${YATT_COMMIT:-}" | tail -n 40 ;;
    *) echo "unknown step $step" ;;
  esac
done

# A device call returns at most 8 files: the runs' JSONs and logs go back as one archive.
cp "$RUNS_DIR"/*.json "$OUT"/ 2>/dev/null
(cd "$OUT" && tar -czf /tmp/verl_bundle.tgz --exclude=verl_bundle.tgz . \
  && find . -mindepth 1 -delete && mv /tmp/verl_bundle.tgz .)
