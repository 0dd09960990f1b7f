#!/usr/bin/env bash
# Runs the CUDA tests and GPU benchmarks on the device machine, one step per argument:
#   bash gpu_checks/gpu_checks.sh placement rollout ckpt balance_nccl
#   bash gpu_checks/gpu_checks.sh megatron trainer_megatron mfu      # the Megatron backend (2 GPUs)
# Each step logs to $OUT/<step>.log and writes its JSON under $OUT; a failing step does not stop
# the others. Our packages come from their src/ folders, so the machine's torch is never replaced.
set -uo pipefail
OUT=${OUT:-/tmp/yatt-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/_gpu_env.sh"  # wheels, PYTHONPATH, NCCL settings, device.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"

for step in "$@"; do
  case $step in
    placement)
      run_step placement_tests python3 -m pytest -q -rs packages/yatt-placement/tests/test_cuda.py
      run_step placement_bench python3 bench/placement/placement.py --device cuda --out "$OUT/placement_cuda.json" ;;
    rollout)
      run_step rollout_tests python3 -m pytest -q -rs packages/yatt-rollout/tests/test_cuda_engine.py \
        packages/yatt-rollout/tests/test_decode_kernel.py \
        packages/yatt-rollout/tests/test_cuda_weights.py packages/yatt-rollout/tests/test_builtin_vision.py
      run_step rollout_bench python3 bench/rollout/rollout_gpu.py --out-dir "$OUT" ;;
    ckpt)
      run_step ckpt_tests python3 -m pytest -q -rs packages/yatt-ckpt/tests/test_cuda.py
      run_step ckpt_bench python3 bench/ckpt/ckpt.py --device cuda --out "$OUT/ckpt_cuda.json" ;;
    balance_nccl)
      run_step balance_nccl python3 -m pytest -q -rs packages/yatt-balance/tests/test_across_ranks_cuda.py ;;
    core)
      run_step core_tests python3 -m pytest -q -rs packages/yatt-core/tests/test_cuda.py
      run_step head_logprobs python3 bench/logprobs/head_logprobs.py --device cuda --tokens 16384 \
        --out "$OUT/head_logprobs_cuda.json" ;;
    multimodal)
      # Images through one RL step: the built-in engine (CUDA graphs) and the VLM policy on GPU.
      run_step multimodal_tests python3 -m pytest -q -rs tests/test_multimodal_loop.py ;;
    genrm)
      run_step genrm_tests python3 -m pytest -q -rs packages/yatt-genrm/tests/test_cuda_judge.py ;;
    cuda_tests)
      # Every single-GPU CUDA test file of the packages (vLLM/SGLang and Megatron ones aside: they
      # need their carried sites), one pytest per package so one package's crash spares the rest.
      # The rollout files took over 420 s alone on an H200 (session 21): run this step detached,
      # or with CUDA_TESTS_XDIST="-n 4 --dist loadfile" (pytest-xdist carried in .whl) to run
      # files side by side (their timing test, test_env_kept_kv's, then shares the GPU).
      R=packages/yatt-rollout/tests
      STEP_TIMEOUT=${CUDA_TESTS_TIMEOUT_S:-900} run_step cuda_tests_rollout python3 -m pytest -q -rs \
        ${CUDA_TESTS_XDIST:-} \
        $R/test_cuda_engine.py $R/test_cuda_sampling.py $R/test_cuda_weights.py \
        $R/test_decode_kernel.py $R/test_env_kept_kv.py $R/test_builtin_lora.py \
        $R/test_builtin_lora_beside.py $R/test_builtin_vision.py \
        $R/test_builtin_vision_kept.py $R/test_kept_kv_batched.py
      run_step cuda_tests_core python3 -m pytest -q -rs packages/yatt-core/tests/test_cuda.py \
        packages/yatt-core/tests/test_lora.py packages/yatt-core/tests/test_runtime.py
      run_step cuda_tests_genrm python3 -m pytest -q -rs packages/yatt-genrm/tests/test_cuda_judge.py
      run_step cuda_tests_placement python3 -m pytest -q -rs packages/yatt-placement/tests/test_cuda.py
      run_step cuda_tests_ckpt python3 -m pytest -q -rs packages/yatt-ckpt/tests/test_cuda.py
      run_step cuda_tests_multimodal python3 -m pytest -q -rs tests/test_multimodal_loop.py ;;
    trainer)
      # The reference trainer on every visible GPU (one rank each), both placement modes.
      NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
      rm -rf /tmp/yatt-runs/full /tmp/yatt-runs/partial /tmp/yatt-runs/features  # warm machine
      run_step trainer_full python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py out_dir=/tmp/yatt-runs/full num_steps=${TRAINER_STEPS:-60}
      cp /tmp/yatt-runs/full/metrics.jsonl "$OUT/trainer_full_metrics.jsonl" 2>/dev/null
      run_step trainer_partial python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py task=text out_dir=/tmp/yatt-runs/partial num_steps=20 placement=partial \
        policy.model_dir=/tmp/yatt-runs/full/embedded/policy \
        data.path=/tmp/yatt-runs/full/embedded/prompts.jsonl \
        reward.judge_dir=/tmp/yatt-runs/full/embedded/judge
      cp /tmp/yatt-runs/partial/metrics.jsonl "$OUT/trainer_partial_metrics.jsonl" 2>/dev/null
      # Streamed sampling: partial colocation (rollout.sampling_mode=stream): prompts keep entering
      # the engine while verdicts come back, the long tail cut once every rank is full.
      rm -rf /tmp/yatt-runs/stream
      run_step trainer_stream python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py task=text out_dir=/tmp/yatt-runs/stream num_steps=10 placement=partial \
        rollout.sampling_mode=stream rollout.oversample=1.5 rollout.max_oversample=4 \
        policy.model_dir=/tmp/yatt-runs/full/embedded/policy \
        data.path=/tmp/yatt-runs/full/embedded/prompts.jsonl \
        reward.judge_dir=/tmp/yatt-runs/full/embedded/judge
      cp /tmp/yatt-runs/stream/metrics.jsonl "$OUT/trainer_stream_metrics.jsonl" 2>/dev/null
      # The trainer's features on the GPU: a KL reference (a placement role), warm-up + cosine lr,
      # eval every 5 steps on the embedded held-out split, the export at the end, reloaded.
      EMB=/tmp/yatt-runs/full/embedded
      run_step trainer_features python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py task=text out_dir=/tmp/yatt-runs/features num_steps=10 \
        policy.model_dir=$EMB/policy data.path=$EMB/prompts.jsonl reward.judge_dir=$EMB/judge \
        eval.path=$EMB/eval.jsonl eval.every_steps=5 loss.kl_coef=0.05 \
        policy.lr_schedule=cosine policy.num_warmup_steps=2
      cp /tmp/yatt-runs/features/metrics.jsonl "$OUT/trainer_features_metrics.jsonl" 2>/dev/null
      # DAPO's recipe (several mini-batches per rollout batch, so the clip acts; rollout
      # correction of the engine's logprobs, with the engine in bf16 beside the fp32 trainer so the
      # IS weights differ from 1; the overlong buffer) on the same embedded task.
      rm -rf /tmp/yatt-runs/dapo
      run_step trainer_dapo python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py --config examples/configs/dapo.yaml task=text out_dir=/tmp/yatt-runs/dapo \
        num_steps=${TRAINER_STEPS:-60} policy.model_dir=$EMB/policy data.path=$EMB/prompts.jsonl \
        reward.judge_dir=$EMB/judge rollout.engine.dtype=bfloat16
      cp /tmp/yatt-runs/dapo/metrics.jsonl "$OUT/trainer_dapo_metrics.jsonl" 2>/dev/null
      python3 gpu_checks/rl_metrics_summary.py "$OUT"/trainer_full_metrics.jsonl \
        "$OUT"/trainer_dapo_metrics.jsonl | tee "$OUT/trainer_rl_summary.txt"
      run_step trainer_export_reload python3 -c "import torch; from transformers import \
AutoModelForCausalLM as M; m = M.from_pretrained('/tmp/yatt-runs/features/export', \
device_map='cuda'); ids = torch.tensor([[51, 43, 52, 61]], device='cuda'); \
print('reloaded', type(m).__name__, m(ids).logits.shape)" ;;
    trainer_vl)
      # The embedded image task (task=vision: a tiny Qwen2-VL counting dots, exact-match reward)
      # on every visible GPU, one rank each: images through the rollout, the train step and the
      # eval; then with a KL reference (images in its forward too). Its reward is a rule, not a
      # judge engine, so placement=partial (a judge beside the rollout) does not apply.
      NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
      rm -rf /tmp/yatt-runs/vl /tmp/yatt-runs/vl-kl  # a warm machine keeps the last call's runs
      run_step trainer_vl_full python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py task=vision out_dir=/tmp/yatt-runs/vl num_steps=${TRAINER_VL_STEPS:-40} \
        eval.every_steps=20
      cp /tmp/yatt-runs/vl/metrics.jsonl "$OUT/trainer_vl_full_metrics.jsonl" 2>/dev/null
      VL=/tmp/yatt-runs/vl/embedded-vision
      run_step trainer_vl_kl python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py task=vision out_dir=/tmp/yatt-runs/vl-kl num_steps=10 \
        policy.model_dir=$VL/policy data.path=$VL/prompts.jsonl data.image_key=image \
        eval.path=$VL/eval.jsonl eval.every_steps=5 loss.kl_coef=0.05
      cp /tmp/yatt-runs/vl-kl/metrics.jsonl "$OUT/trainer_vl_kl_metrics.jsonl" 2>/dev/null ;;
    trainer_lora)
      # The embedded task with LoRA (rank 8; the lr found on CPU for it) and a KL term (the base
      # under the disabled adapter is the reference: no frozen copy); each step syncs only the
      # adapter to the built-in engine. train/rollout_mismatch stays near 0 when it is served.
      NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
      rm -rf /tmp/yatt-runs/lora  # a warm machine keeps the last call's run
      run_step trainer_lora python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py out_dir=/tmp/yatt-runs/lora num_steps=20 policy.lora.rank=8 \
        policy.lr=2e-3 loss.kl_coef=0.05
      cp /tmp/yatt-runs/lora/metrics.jsonl "$OUT/trainer_lora_metrics.jsonl" 2>/dev/null ;;
    trainer_real)
      # examples/configs/qwen_rewards_gpu.yaml (reward functions, KL reference, cosine lr, eval,
      # export) on a locally saved Qwen2-shaped model (Qwen2.5-0.5B's layer shapes, random
      # weights, a byte-level vocabulary) and the embedded task's prompts; then the export
      # reloaded with transformers. Needs the embedded task of the `trainer` step.
      EMB=/tmp/yatt-runs/full/embedded
      run_step trainer_real_model python3 -c "from yatt.testing import make_tiny_causal_lm; \
make_tiny_causal_lm('/tmp/yatt-runs/qwen2-0.5b', arch='qwen2', hidden_size=896, num_layers=24, \
num_heads=14, num_kv_heads=2, intermediate_size=4864, max_position_embeddings=2048, \
tie_word_embeddings=True)"
      NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
      rm -rf /tmp/yatt-runs/real  # a warm machine keeps the last call's run
      run_step trainer_real python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        examples/train_grpo.py --config examples/configs/qwen_rewards_gpu.yaml \
        out_dir=/tmp/yatt-runs/real num_steps=6 policy.model_dir=/tmp/yatt-runs/qwen2-0.5b \
        data.path=$EMB/prompts.jsonl "data.split=''" eval.path=$EMB/eval.jsonl "eval.split=''" \
        eval.every_steps=3 eval.num_prompts=32 data.prompts_per_rank=8 rollout.max_new_tokens=32 \
        rollout.engine.max_seq_len=128
      cp /tmp/yatt-runs/real/metrics.jsonl "$OUT/trainer_real_metrics.jsonl" 2>/dev/null
      run_step trainer_real_reload python3 -c "import torch; from transformers import \
AutoModelForCausalLM as M; m = M.from_pretrained('/tmp/yatt-runs/real/export', device_map='cuda'); \
print('reloaded', type(m).__name__, m.dtype, m(torch.tensor([[51, 43, 52]], device='cuda')).logits.shape)" ;;
    megatron)
      run_step megatron_parity python3 bench/megatron/megatron_parity.py --out-dir "$OUT" ;;
    trainer_megatron)
      # The reference trainer with backend=megatron (examples/configs/tiny_megatron.yaml, bf16),
      # 8 steps, a checkpoint at step 4: 1 GPU in both placement modes (side by side, one GPU
      # each; the partial run in float32), then 2 GPUs as TP=2 (full) and as DP=2 (partial).
      # The embedded task is built once on the CPU (reused from the `trainer` step's).
      EMB=/tmp/yatt-runs/full/embedded
      if [ ! -f "$EMB/READY" ]; then
        EMB=/tmp/yatt-runs/mg/embedded
        STEP_TIMEOUT=240 run_step trainer_megatron_prepare python3 -c "import sys; \
sys.path.insert(0, 'examples'); import grpo_config; from tasks import tiny_task; from pathlib import Path; \
from yatt.genrm import JudgeTemplate; tiny_task.prepare_locked(Path('$EMB'), \
JudgeTemplate(user=grpo_config.DEMO_DEFAULTS['reward']['judge_template']))"
      fi
      MG=(--config examples/configs/tiny_megatron.yaml task=text num_steps=8 ckpt.every_steps=4
          policy.model_dir=$EMB/policy data.path=$EMB/prompts.jsonl reward.judge_dir=$EMB/judge)
      rm -rf /tmp/yatt-runs/mg_*
      mg_run() {  # name, GPUs, nproc, overrides...
        local name=$1 gpus=$2 nproc=$3; shift 3
        CUDA_VISIBLE_DEVICES=$gpus STEP_TIMEOUT=240 run_step "trainer_megatron_$name" \
          python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
          examples/train_grpo.py "${MG[@]}" out_dir=/tmp/yatt-runs/mg_$name "$@"
        cp "/tmp/yatt-runs/mg_$name/metrics.jsonl" "$OUT/trainer_megatron_${name}_metrics.jsonl" 2>/dev/null
      }
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        mg_run 1gpu_full 0 1 policy.tp_size=1 placement=full &
        # float32 (the embedded default's precision): fp32 params are views of DDP's buffer
        mg_run 1gpu_partial_fp32 1 1 policy.tp_size=1 placement=partial policy.dtype=float32 &
        wait
        mg_run tp2_full 0,1 2 policy.tp_size=2 placement=full
        mg_run dp2_partial 0,1 2 policy.tp_size=1 placement=partial
      else
        mg_run 1gpu_full 0 1 policy.tp_size=1 placement=full
        mg_run 1gpu_partial 0 1 policy.tp_size=1 placement=partial
      fi
      # One line per run: steps done, reward first -> last, median phase times.
      python3 - "$OUT" <<'PY' | tee "$OUT/trainer_megatron_summary.txt"
import json, statistics, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("trainer_megatron_*_metrics.jsonl")):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if not rows:
        continue
    times = {k[5:-2]: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[-1] if k.startswith("time/")}
    print(path.name[17:-14], f"steps {len(rows)} reward {rows[0]['reward/mean']:.3f} -> "
          f"{rows[-1]['reward/mean']:.3f} skipped {sum(r['train/is_skipped'] for r in rows):.0f}",
          " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in sorted(times.items())))
PY
      ;;
    mfu)
      # Train-phase MFU of MegatronPolicy (~0.5B Qwen2 shape, seq 2048, sdpa and Megatron's
      # attention) and the memory it frees asleep, on one GPU.
      CUDA_VISIBLE_DEVICES=0 STEP_TIMEOUT=300 run_step megatron_mfu python3 bench/megatron/megatron_mfu.py --out-dir "$OUT" ;;
    trainer_tools)
      # The embedded multi-turn task (task=tools: guess a number with a `guess` tool, the
      # environment's reward) on one GPU: the multi-turn rollout kind through the built-in
      # engine (KV kept between turns), tools in worker processes; its metrics copied to $OUT
      # (dynamic_sampling/multiturn/*: tool calls, errors by cause, turns, end causes).
      rm -rf /tmp/yatt-runs/tools  # a warm machine keeps the last call's run
      CUDA_VISIBLE_DEVICES=0 run_step trainer_tools python3 examples/train_grpo.py task=tools \
        out_dir=/tmp/yatt-runs/tools num_steps=${TRAINER_TOOLS_STEPS:-20}
      cp /tmp/yatt-runs/tools/metrics.jsonl "$OUT/trainer_tools_metrics.jsonl" 2>/dev/null ;;
    lora_tests)
      # Issue 45's CUDA tests alone (cuda_tests runs them too): the adapter merged, and beside
      # the base GEMMs under CUDA graphs and compile, its buffers reserved, a bound adapter
      # refreshed in place. A minute or two; before bench_lora in the same job.
      R=packages/yatt-rollout/tests
      run_step lora_tests python3 -m pytest -q -rs -k cuda $R/test_builtin_lora_beside.py \
        $R/test_builtin_lora.py ;;
    bench_lora)
      # Issue 45's GPU bars (bench/lora/lora_gpu.py): LoRA rank 16 vs full fine-tuning, 7B policy
      # + 7B judge, long-tail mix (speed at offload auto, peak memory at offload always), then
      # LoRA 14B beside the 7B judge; each variant its own process, lora_<gpu>.json/.md
      # rewritten after each, a later call's variants added to the same commit's. LORA_BUDGET_S
      # bounds the whole step (no variant starts with < 60 s left; 540: one 10-minute device
      # call): five variants need two or three calls, e.g. LORA_ARGS="--variants full-7b
      # lora16-7b", then "--variants full-7b-always lora16-7b-always", then "--variants
      # lora16-14b"; "--warmup 1 --steps 2" shortens each.
      STEP_TIMEOUT=$(( ${LORA_BUDGET_S:-540} + 30 )) run_step bench_lora python3 bench/lora/lora_gpu.py \
        --out-dir "$OUT" --budget-s "${LORA_BUDGET_S:-540}" ${LORA_ARGS:-} ;;
    bench_multiturn)
      # Issue 44's first bar (bench/rollout/multiturn_kv.py): 4-turn rollouts with 1k-token
      # observations, KV kept between turns vs the history prefilled each turn; 0.5B and 1.5B.
      STEP_TIMEOUT=${MULTITURN_TIMEOUT_S:-600} run_step bench_multiturn python3 \
        bench/rollout/multiturn_kv.py --out-dir "$OUT" ${MULTITURN_ARGS:-} ;;
    bench_multiturn_vllm)
      # Issue 44's third bar (bench/rollout/multiturn_kv.py --vllm): the same kept-KV rounds,
      # then the same requests through yatt's VLLMEngine (prefix caching on). Needs vLLM's site:
      # its pieces carried (scripts/pack_engine_site.sh) and `bash bench/rollout/engines_gpu.sh
      # unpack` run first in the same machine.
      HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
        PYTHONPATH="/root/site_vllm:$PYTHONPATH" STEP_TIMEOUT=${MULTITURN_TIMEOUT_S:-300} \
        run_step bench_multiturn_vllm python3 bench/rollout/multiturn_kv.py --vllm --in-process \
        --out-dir "$OUT" ${MULTITURN_ARGS:---shapes 0.5b} ;;
    bench_multiturn_judge)
      # Issue 44's second bar (bench/rollout/multiturn_judge.py): rollout + judge time per kept
      # group, trajectories judged as each ends (partial colocation) vs after the rollout (full);
      # 0.5B policy, 1.5B judge, 1 to 6 turns with a long tail.
      STEP_TIMEOUT=${MULTITURN_JUDGE_TIMEOUT_S:-420} run_step bench_multiturn_judge python3 \
        bench/rollout/multiturn_judge.py --out-dir "$OUT" ${MULTITURN_JUDGE_ARGS:-} ;;
    bench_refresh)
      # Issue 45's sync bar taken apart (bench/lora/refresh_gpu.py, under a minute): a bound
      # adapter's refresh on 7B shapes per way (as built, a copy-then-scale candidate, the
      # one-storage floor), a 7B full copy's floor, the engine's overhead, a profile.
      STEP_TIMEOUT=240 run_step bench_refresh python3 bench/lora/refresh_gpu.py --out-dir "$OUT" ;;
    bench_lora_modes)
      # Issue 45 (bench/lora/lora_modes_gpu.py): the built-in engine's LoRA served merged vs
      # beside the base GEMMs (decode per batch bucket at equal memory, sync time), then a
      # self-judge on the policy's base view vs a separate copy of the 7B base (peak memory);
      # first the CUDA tests of lora_mode=beside and the self-judge (graphs, compiled decode).
      run_step lora_modes_tests python3 -m pytest -q -rs \
        packages/yatt-rollout/tests/test_builtin_lora_beside.py \
        packages/yatt-rollout/tests/test_builtin_lora.py packages/yatt-genrm/tests/test_self_judge.py
      STEP_TIMEOUT=${LORA_MODES_TIMEOUT_S:-540} run_step bench_lora_modes python3 \
        bench/lora/lora_modes_gpu.py --out-dir "$OUT" ${LORA_MODES_ARGS:-} ;;
    bench_compile_time)
      # The first call's compile time (bench/rollout/compile_time.py): the built-in engine with
      # compile_scope "step" (the default) and "layers" (each decoder layer compiled once), each
      # its own process and empty inductor cache: 28 layers at width 64 (Qwen2.5-7B's depth,
      # the compile's time, not the math's) and the 0.5B shape, whose steady decode (64 rows x
      # 256 forced tokens, CUDA graphs) says whether "layers" can become the default.
      STEP_TIMEOUT=${COMPILE_TIME_TIMEOUT_S:-540} run_step bench_compile_time python3 \
        bench/rollout/compile_time.py --device cuda --layers 28 --shapes 0.5b \
        --kinds engine engine-layers --decode 64 256 --out-dir "$OUT" ${COMPILE_TIME_ARGS:-} ;;
    bench_offpolicy)
      # Issue 48's one-GPU run (bench/train/offpolicy_gpu.py): the trainer at
      # rollout.max_staleness 0, 1, 2 (placement=partial), 0.5B policy (EOS shaped for a long-tail
      # length mix) + 1.5B judge: step time, GPU busy fraction, staleness histogram, IS by age,
      # reward curve, response lengths asked and got; offpolicy_<gpu>.json/.md rewritten after
      # each s. OFFPOLICY_ARGS e.g. "--steps 30 --max-new-tokens 256" ("--length-mix cap": every
      # response at the cap, the run before the shaping).
      CUDA_VISIBLE_DEVICES=0 STEP_TIMEOUT=${OFFPOLICY_TIMEOUT_S:-590} run_step bench_offpolicy \
        python3 bench/train/offpolicy_gpu.py --out-dir "$OUT" ${OFFPOLICY_ARGS:-} ;;
    bench_offpolicy_separate)
      # Issue 48's several-GPU run (two GPUs): the same runs with placement=separate, the
      # trainer on GPU 0 and the rollout and judge engines on GPU 1 (the weights copied GPU to
      # GPU each step); bar: s = 1 step time <= 0.6x s = 0. offpolicy_<gpu>_separate.json/.md.
      CUDA_VISIBLE_DEVICES=0,1 STEP_TIMEOUT=${OFFPOLICY_TIMEOUT_S:-590} run_step \
        bench_offpolicy_separate python3 bench/train/offpolicy_gpu.py --out-dir "$OUT" \
        --placement separate ${OFFPOLICY_ARGS:-} ;;
    *)
      echo "unknown step $step"; exit 2 ;;
  esac
done
