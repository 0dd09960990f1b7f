#!/usr/bin/env bash
# Runs the CUDA tests and GPU benchmarks on the device machine, one step per argument:
#   bash bench/gpu_checks.sh placement rollout ckpt balance_nccl
# Each step logs to $OUT/<step>.log and writes its JSON under $OUT; a failing step does not stop
# the others. Our packages come from their src/ folders, so the machine's torch is never replaced.
set -uo pipefail
OUT=${OUT:-/tmp/yatt-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
SRC=$(ls -d packages/*/src | tr '\n' ':')
export PYTHONPATH="/tmp/site:${SRC}${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"

run_step() {
  local name=$1; shift
  local start=$SECONDS
  echo "=== $name"
  timeout "${STEP_TIMEOUT:-420}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.log"
}

for step in "$@"; do
  case $step in
    placement)
      run_step placement_tests python3 -m pytest -q -rs packages/yatt-placement/tests/test_cuda.py
      run_step placement_bench python3 bench/placement.py --device cuda --out "$OUT/placement_cuda.json" ;;
    rollout)
      run_step rollout_tests python3 -m pytest -q -rs packages/yatt-rollout/tests/test_cuda_engine.py
      run_step rollout_bench python3 bench/rollout_gpu.py --out-dir "$OUT" ;;
    ckpt)
      run_step ckpt_tests python3 -m pytest -q -rs packages/yatt-ckpt/tests/test_cuda.py
      run_step ckpt_bench python3 bench/ckpt.py --device cuda --out "$OUT/ckpt_cuda.json" ;;
    balance_nccl)
      run_step balance_nccl python3 -m pytest -q -rs packages/yatt-balance/tests/test_dist_cuda.py ;;
    core)
      run_step core_tests python3 -m pytest -q -rs packages/yatt-core/tests/test_cuda.py ;;
    genrm)
      run_step genrm_tests python3 -m pytest -q -rs packages/yatt-genrm/tests/test_cuda_judge.py ;;
    trainer)
      # The reference trainer on every visible GPU (one rank each), both placement modes.
      NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
      run_step trainer_full python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py out_dir=/tmp/yatt-runs/full num_steps=60
      cp /tmp/yatt-runs/full/metrics.jsonl "$OUT/trainer_full_metrics.jsonl" 2>/dev/null
      run_step trainer_partial python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py out_dir=/tmp/yatt-runs/partial num_steps=20 placement=partial \
        policy.model_dir=/tmp/yatt-runs/full/embedded/policy \
        data.path=/tmp/yatt-runs/full/embedded/prompts.jsonl \
        reward.judge_dir=/tmp/yatt-runs/full/embedded/judge
      cp /tmp/yatt-runs/partial/metrics.jsonl "$OUT/trainer_partial_metrics.jsonl" 2>/dev/null ;;
    megatron)
      run_step megatron_parity python3 bench/megatron_parity.py --out-dir "$OUT" ;;
    *)
      echo "unknown step $step"; exit 2 ;;
  esac
done
