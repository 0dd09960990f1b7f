#!/usr/bin/env bash
# vLLM and SGLang on the device machine, one step per argument:
#   bash bench/rollout/engines_gpu.sh unpack probe vllm_tests sglang_tests bench
#   PIECES_WAIT=vllm:3 bash bench/rollout/engines_gpu.sh wait_pieces unpack vllm_tests  # detached
#
# The machine has no registry, so each engine's site-packages (its wheels installed here with
# `pip install --target`, cp312, minus what the machine already has) arrive as xz pieces in
# /root/wheels/<name>_site.tar.xz.part-*, one piece per device call (scripts/pack_engine_site.sh
# makes them). `unpack` joins them into /root/site_vllm and /root/site_sgl; each engine then
# runs in its own process with its own site first on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/yatt-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/../../gpu_checks/_gpu_env.sh"  # PYTHONPATH for our packages, NCCL settings, device.txt
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false

# The built-in engine borrows torch_memory_saver from SGLang's site (the image lacks it).
site_of() { case $1 in vllm) echo /root/site_vllm ;; *) echo /root/site_sgl ;; esac; }
with_engine() {  # with_engine <engine> cmd...: the engine's site-packages first on the path
  local site; site=$(site_of "$1"); shift
  PYTHONPATH="${site:+$site:}$PYTHONPATH" "$@"
}

unpack() {
  for name in vllm sgl; do
    [ -d "/root/site_$name" ] && continue
    ls /root/wheels/${name}_site.tar.xz.part-* >/dev/null 2>&1 || { echo "no pieces for $name"; continue; }
    cat /root/wheels/${name}_site.tar.xz.part-* | python3 -c \
      "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root')"
    du -sh "/root/site_$name"
  done
  # SGLang's FA3 kernels (sgl_kernel/flash_ops.abi3.so, 1.1 GB; its default attention on
  # Hopper) travel in pieces of their own: `scripts/pack_engine_site.sh sglang_fa3`.
  if ls /root/wheels/sgl_fa3_site.tar.xz.part-* >/dev/null 2>&1 && [ -d /root/site_sgl ] \
      && [ ! -f /root/site_sgl/sgl_kernel/flash_ops.abi3.so ]; then
    cat /root/wheels/sgl_fa3_site.tar.xz.part-* | python3 -c \
      "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root')"
    ls -la /root/site_sgl/sgl_kernel/flash_ops.abi3.so
  fi
  # The built-in engine (a trainer's judge beside vLLM) needs torch_memory_saver: SGLang has it.
  [ -d /root/site_vllm/torch_memory_saver ] || cp -r /root/site_sgl/torch_memory_saver* /root/site_vllm/
}

probe() {  # what each engine imports, and which of its requirements the machine does not meet
  with_engine vllm python3 bench/_common/probe_site.py --tag vllm --dists vllm \
    --modules vllm,vllm.entrypoints.llm,vllm.v1.worker.gpu_worker
  with_engine sglang python3 bench/_common/probe_site.py --tag sglang --dists sglang \
    --modules sglang,sglang.srt.entrypoints.engine,sgl_kernel
}

wait_pieces() {  # until every piece of PIECES_WAIT ("vllm:3") is in /root/wheels, or the limit
  # A detached job (gpu_checks/background.sh) whose later device calls each bring one piece:
  # each call copies its piece to a temporary name and renames it (a rename is atomic), so a
  # piece seen here is whole.
  local spec=${PIECES_WAIT:-vllm:3} limit=${PIECES_WAIT_S:-900} start=$SECONDS
  local name=${spec%%:*} count=${spec##*:}
  [ "$name" = sglang ] && name=sgl
  until [ "$(ls /root/wheels/${name}_site.tar.xz.part-* 2>/dev/null | wc -l)" -ge "$count" ]; do
    if [ $((SECONDS - start)) -ge "$limit" ]; then
      echo "wait_pieces: $(ls /root/wheels/${name}_site.tar.xz.part-* 2>/dev/null | wc -l) of $count ${name} pieces after ${limit}s"
      return 1
    fi
    sleep 5
  done
  echo "wait_pieces: $count ${name} pieces after $((SECONDS - start))s"
}

for step in "$@"; do
  case $step in
    unpack) unpack ;;
    wait_pieces) wait_pieces || exit 1 ;;
    probe) probe 2>&1 | tee "$OUT/probe.log" | grep -v "^$" ;;
    vllm_tests)
      run_step vllm_tests env YATT_ENGINE=vllm PYTHONPATH="/root/site_vllm:$PYTHONPATH" \
        python3 -m pytest -q -rs -p no:cacheprovider packages/yatt-rollout/tests/test_gpu_engines.py ;;
    sglang_tests)
      run_step sglang_tests env YATT_ENGINE=sglang PYTHONPATH="/root/site_sgl:$PYTHONPATH" \
        python3 -m pytest -q -rs -p no:cacheprovider packages/yatt-rollout/tests/test_gpu_engines.py ;;
    bench)
      # The engine table (issue 28, bench/rollout/engines.py): one process per ENGINE:SHAPE:GROUP,
      # each engine started once per shape and measured in every mode of its group (decode at
      # batch 64 and 256, 512 new tokens; the judge-like load). Long: start it detached,
      #   bash gpu_checks/background.sh start engines bash bench/rollout/engines_gpu.sh unpack bench
      # Estimate, from the H100 sessions' start-ups (vLLM 42-77 s first, 26 s with its compile
      # cache; SGLang 60 s; built-in 1 s) plus ~10 s of imports a process, and ~35 s of timed
      # calls a mode (3 repeats): a shape's full set (5 processes, 9 modes) ~10 min on 0.5B; the
      # bars' rows alone (built-in, vLLM's own API, SGLang unseeded: 3 processes, 5 modes)
      # ~5.5 min on 1.5B; with unpack and the model saves ~16-17 min in all. So: every group on the
      # shapes of BENCH_FULL_SHAPES (0.5b: the host-bound one, where an adapter's cost shows
      # most), the bars' rows on the rest of BENCH_SHAPES (0.5b,1.5b; add 7b for ~+7 min).
      # BENCH_RUNS (comma-separated ENGINE:SHAPE[:GROUP]) replaces the list, e.g.
      #   BENCH_RUNS=builtin:0.5b,sglang:0.5b:unseeded;  BENCH_REPEATS: timed calls (3);
      #   BENCH_BATCHES: decode batches (64,256; "none": the judge-like load alone).
      # JSON kept in BENCH_DIR (default $OUT): a later report merges every run's file.
      dir=${BENCH_DIR:-$OUT}; mkdir -p "$dir"
      export YATT_COMMIT=${YATT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
      IFS=, read -r -a shapes <<<"${BENCH_SHAPES:-0.5b,1.5b}"
      runs=()
      for s in "${shapes[@]}"; do  # the bars' rows first: if time runs out, the ratios stand
        runs+=("builtin:$s" "vllm:$s:native" "sglang:$s:unseeded")
        [[ ",${BENCH_FULL_SHAPES:-0.5b}," == *",$s,"* ]] && runs+=("vllm:$s:adapter" "sglang:$s:seeded")
      done
      [ -n "${BENCH_RUNS:-}" ] && IFS=, read -r -a runs <<<"$BENCH_RUNS"
      run_step bench_prepare env PYTHONPATH="$PYTHONPATH" \
        python3 bench/rollout/engines.py --prepare "${BENCH_SHAPES:-0.5b,1.5b}"
      for run in "${runs[@]}"; do
        tag=${run//:/_}; site=$(site_of "${run%%:*}")
        run_step "bench_$tag" env PYTHONPATH="${site:+$site:}$PYTHONPATH" \
          python3 bench/rollout/engines.py --run "$run" --repeats "${BENCH_REPEATS:-3}" \
          --batches "${BENCH_BATCHES:-64,256}" --out "$dir/engines_table_$tag.json"
      done
      python3 bench/rollout/engines.py --report "$dir"/engines_table_*.json --md "$OUT/engines.md"
      [ "$dir" = "$OUT" ] || cp "$dir"/engines_table_*.json "$OUT/" ;;
    trainer_vllm|trainer_sglang|trainer_vllm_partial|trainer_sglang_partial)
      # The reference trainer on the embedded task with vLLM/SGLang as the rollout engine
      # (bf16 engine, float32 policy), 30 steps; the embedded models are built once and shared.
      engine=${step#trainer_}; placement=full
      case $engine in *_partial) engine=${engine%_partial}; placement=partial ;; esac
      site=$(site_of "$engine"); run=/tmp/yatt-runs/$step; shared=/tmp/yatt-runs/embedded
      opts=(rollout.backend_options.dtype=bfloat16)
      if [ "$engine" = vllm ]; then opts+=(rollout.backend_options.gpu_memory_utilization=0.2)
      else opts+=(rollout.backend_options.mem_fraction_static=0.2
                  rollout.backend_options.engine_kwargs.attention_backend=triton); fi
      if [ -d $shared/policy ]; then
        opts+=(policy.model_dir=$shared/policy data.path=$shared/prompts.jsonl reward.judge_dir=$shared/judge)
      fi
      run_step "$step" env PYTHONPATH="$site:$PYTHONPATH" python3 "${TRAINER:-examples/train_grpo.py}" \
        out_dir=$run num_steps=${TRAINER_STEPS:-30} placement=$placement rollout.backend=$engine "${opts[@]}"
      [ -d $shared/policy ] || cp -r $run/embedded $shared 2>/dev/null
      cp $run/metrics.jsonl "$OUT/${step}_metrics.jsonl" 2>/dev/null ;;
    trainer_config_sglang|trainer_config_vllm)
      # The example configs whose judge runs on the engine too (examples/configs/
      # sglang_partial_gpu.yaml: SGLang rollout + SGLang judge resident together, trainer
      # offloaded; vllm_full_gpu.yaml: vLLM for both, phases in turn), on the embedded task.
      engine=${step#trainer_config_}; site=$(site_of "$engine"); run=/tmp/yatt-runs/$step
      shared=/tmp/yatt-runs/embedded
      case $engine in
        sglang) config=examples/configs/sglang_partial_gpu.yaml
                opts=(rollout.backend_options.engine_kwargs.attention_backend=triton
                      reward.backend_options.engine_kwargs.attention_backend=triton) ;;
        *) config=examples/configs/vllm_full_gpu.yaml; opts=() ;;
      esac
      if [ -d $shared/policy ]; then
        opts+=(policy.model_dir=$shared/policy data.path=$shared/prompts.jsonl reward.judge_dir=$shared/judge)
      fi
      run_step "$step" env PYTHONPATH="$site:$PYTHONPATH" python3 examples/train_grpo.py \
        --config $config out_dir=$run num_steps=${TRAINER_STEPS:-30} "${opts[@]}"
      [ -d $shared/policy ] || cp -r $run/embedded $shared 2>/dev/null
      cp $run/metrics.jsonl "$OUT/${step}_metrics.jsonl" 2>/dev/null ;;
    step_*)
      # bench/step/step.py with each engine as the rollout backend (STEP_RUNS: "layout:backend"
      # pairs), 1 GPU, --judge-tokens 128 as bench/step/step_gpu.sh; JSONs kept in STEP_DIR.
      # STEP_ENGINE_MEMORY (the engine's GPU share, 0.3), STEP_MIX (fixed,longtail), STEP_OFFLOAD
      # (always) and STEP_WARMUP (2): issue 27's bar is vLLM at 0.5 beside the built-in judge and
      # the trainer, offload auto, long tail, 20 steps:
      #   STEP_RUNS=full:vllm STEP_ENGINE_MEMORY=0.5 STEP_MIX=longtail STEP_OFFLOAD=auto \
      #   STEP_WARMUP=1 STEP_STEPS=20 bash bench/rollout/engines_gpu.sh step_share
      dir=${STEP_DIR:-$OUT/steps}; mkdir -p "$dir"
      python3 bench/step/step.py --prepare --model-dir /tmp/yatt-step >/dev/null
      IFS=, read -r -a pairs <<<"${STEP_RUNS:-full:builtin,full:vllm,full:sglang}"
      for pair in "${pairs[@]}"; do
        layout=${pair%%:*}; backend=${pair##*:}; site=""
        [ "$backend" != builtin ] && site=$(site_of "$backend")
        kwargs='{}'; [ "$backend" = sglang ] && kwargs='{"attention_backend": "triton"}'
        run_step "step_${layout}_$backend" env PYTHONPATH="${site:+$site:}$PYTHONPATH" \
          python3 bench/step/step.py --layout "$layout" --rollout-backend "$backend" \
          --engine-kwargs "$kwargs" --model-dir /tmp/yatt-step --out-dir "$dir" \
          --judge-tokens 128 --steps ${STEP_STEPS:-5} --mix "${STEP_MIX:-fixed,longtail}" \
          --engine-memory "${STEP_ENGINE_MEMORY:-0.3}" --offload "${STEP_OFFLOAD:-always}" \
          --warmup "${STEP_WARMUP:-2}"
      done
      python3 bench/step/step.py --report --results-dir "$dir" && cp "$dir"/step_* "$OUT/" ;;
    *) echo "unknown step $step" ;;
  esac
done

# A device call returns at most 8 files: everything goes back as one archive.
(cd "$OUT" && tar -czf /tmp/engines_bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/engines_bundle.tgz .)
