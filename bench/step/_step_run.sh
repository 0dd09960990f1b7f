# Sourced by bench/step/step_gpu.sh and bench/step/step_gpu8.sh after they set RUNS, START, BUDGET_S and
# RUN_TIMEOUT. run NAME CMD...: one run, logged to $RUNS/NAME.log, its progress lines echoed;
# skipped once the call's budget is spent.
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
