# Sourced by every GPU script (gpu_checks/gpu_checks.sh; bench/step/step_gpu*.sh, bench/rollout/engines_gpu.sh,
# bench/verl/verl_gpu.sh): the device machine's environment. Run from the repository root.
# Carried wheels (.whl/) go to /tmp/site and our packages come from their src/ folders, so the
# machine's torch is never replaced; NVLink multicast stays off (the device README says why).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
SRC=$(ls -d packages/*/src | tr '\n' ':')
export PYTHONPATH="/tmp/site:${SRC}${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"

# run_step NAME CMD...: one step's log to $OUT/NAME.log (STEP_TIMEOUT s at most), then its tail
# (TAIL_LINES); a failing step does not stop the next.
# SKIP_STEPS="a b": step names to leave out (e.g. benches when device time is short).
run_step() {
  local name=$1; shift
  if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then echo "=== $name skipped (SKIP_STEPS)"; return 0; fi
  local start=$SECONDS
  echo "=== $name"
  timeout "${STEP_TIMEOUT:-420}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - start))s"
  tail -n "${TAIL_LINES:-25}" "$OUT/$name.log"
}
