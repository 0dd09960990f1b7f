"""Layout (d) of bench/step/step.py: TRL's GRPOTrainer on the same model, batch and lengths.

    python3 bench/step/step_trl.py --out-dir OUT                 # 1 GPU (trl from .whl/ wheels)
    python bench/step/step_trl.py --tiny --steps 1 --out-dir /tmp/o   # CPU, catches API mistakes
    python3 bench/step/step_trl.py --use-vllm --judge-tokens 128 --out-dir OUT  # TRL + vLLM colocate

trl is imported lazily (it is no yatt dependency). Settings: trl's GRPOTrainer without vLLM
(transformers `generate`), beta=0 (no reference model), 16 prompts x 8 completions per optimizer
step (per_device_train_batch_size x gradient_accumulation_steps = 128 = one generation batch),
prompts of 128 tokens, completions forced to 256 tokens (max_completion_length=256 and
generation_kwargs min_new_tokens=256, which masks EOS until then), float32 weights with bf16
autocast (trl's default load, bf16=True), the same random Qwen2.5-0.5B-shaped policy directory.
Reward: the same GenRM judge as yatt's layouts (a yatt.genrm.GenRM on a BuiltinEngine, resident
on the same GPU) called as a plain python reward function, so both sides judge the same texts.
Per-step time: a TrainerCallback timestamps on_step_begin/on_step_end; rollout+reward is the time
inside _generate_and_score_completions, reward alone the judge call.

--use-vllm: GRPOTrainer(use_vllm=True, vllm_mode="colocate"), the mode TRL documents for one
GPU (TRL 1.16 takes vLLM 0.22 to 0.31: the carried 0.26.0). vLLM in bf16 takes --vllm-memory of
the GPU (TRL's default 0.3, yatt's --engine-memory default too); lengths forced by vLLM's own
SamplingParams(ignore_eos=True) with max_tokens = 256 (TRL passes generation_kwargs to
SamplingParams). TRL syncs the policy's weights into vLLM before each generation (inside the
rollout time here). --vllm-sleep: vllm_enable_sleep_mode (off by default, as in TRL). Writes
trl_vllm_1gpu.json (not step_*.json: bench/step/step.py's report keeps reading the HF run as (d)).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _step_setup as setup  # bench/ is not a package


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (first-touch memory)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument(
        "--mix", default="fixed", help="accepted for bench/step/step.py's flags; TRL runs 'fixed'"
    )
    p.add_argument("--judge-tokens", type=int, default=8)
    p.add_argument("--reward", choices=("judge", "constant"), default="judge")
    p.add_argument("--per-device-batch", type=int, default=32, help="completions per micro-batch")
    p.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="turn off trl's default activation checkpointing (yatt's TorchPolicy runs without)",
    )
    p.add_argument("--use-vllm", action="store_true", help="vLLM colocate mode for generation")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vllm_gpu_memory_utilization")
    p.add_argument("--vllm-sleep", action="store_true", help="vllm_enable_sleep_mode")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--out-dir", default="bench/results/step_runs")
    args = p.parse_args(argv)
    if not 0.0 < args.vllm_memory < 1.0:
        p.error(f"--vllm-memory {args.vllm_memory}: a GPU share in (0, 1)")
    if args.model_dir is None:
        name = "yatt-step-tiny" if args.tiny else "yatt-step"
        args.model_dir = str(Path(tempfile.gettempdir()) / name)
    return args


def main(argv: list[str]) -> Path:
    args = parse_args(argv)
    started_at = time.time()  # wall clock: the report refuses ratios of overlapping runs
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from yatt import genrm

    work = setup.workload(args)
    policy_dir, judge_dir = setup.make_models(Path(args.model_dir), tiny=args.tiny)
    num_steps = args.warmup + args.steps
    is_cuda = torch.cuda.is_available()
    if args.tiny:
        torch.set_num_threads(1)
    prompts = [t for step in range(num_steps) for t in setup.prompt_texts(work, step)]
    timings: dict[str, list[float]] = {"begin": [], "end": [], "gen": [], "reward": []}
    lengths: list[int] = []

    judge = None
    if args.reward == "judge":
        judge, _ = setup.build_judge(
            judge_dir,
            device="cuda" if is_cuda else "cpu",
            tiny=args.tiny,
            work=work,
            slots=work.num_samples,
        )

    def judge_reward(prompts, completions, completion_ids, **kwargs):
        t0 = time.perf_counter()
        lengths.extend(len(ids) for ids in completion_ids)
        if judge is None:
            rewards = [0.0] * len(completion_ids)
        else:
            samples = [
                genrm.Sample(prompt=p, response=setup.ids_to_text(list(ids)))
                for p, ids in zip(prompts, completion_ids, strict=True)
            ]
            rewards = [v.reward for v in judge.score(samples)]
        timings["reward"].append(time.perf_counter() - t0)
        return rewards

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timings["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if is_cuda:
                torch.cuda.synchronize()
            timings["end"].append(time.perf_counter())

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timings["gen"].append(time.perf_counter() - t0)
            return out

    batch = min(args.per_device_batch, work.num_samples)
    config = GRPOConfig(
        output_dir=str(Path(tempfile.mkdtemp(prefix="trl-step-"))),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=work.num_samples // batch,
        num_generations=work.group_size,
        max_completion_length=256,
        temperature=1.0,
        beta=0.0,
        **generation_settings(args, work),
        learning_rate=1e-6,
        bf16=is_cuda,
        max_steps=num_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        shuffle_dataset=False,
        disable_tqdm=True,
        use_cpu=not is_cuda,
        gradient_checkpointing=not args.no_gradient_checkpointing,  # trl's default: on
        seed=0,
    )
    trainer = TimedGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=judge_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[StepClock()],
    )
    # max_steps counts optimizer steps; one generation batch (16 x 8) feeds each of them.
    trainer.train()

    # Each optimizer step's span: its first micro-step's begin to its end (the generation of
    # its batch happens inside the first micro-step).
    ga = config.gradient_accumulation_steps
    begins = timings["begin"][::ga] if len(timings["begin"]) > num_steps else timings["begin"]
    step_s = [e - b for b, e in zip(begins, timings["end"], strict=False)]
    timed = step_s[args.warmup :]
    gen, reward = timings["gen"][args.warmup :], timings["reward"][args.warmup :]
    med = statistics.median
    phases = {
        "rollout": med(g - r for g, r in zip(gen, reward, strict=False)),
        "genrm": med(reward),
        "train": med(s - g for s, g in zip(timed, gen, strict=False)),
    }
    forced = all(n == 256 for n in lengths)
    run = {
        "layout": "trl-vllm" if args.use_vllm else "trl",
        "label": "(d) TRL GRPOTrainer "
        + (f"(vLLM {_version('vllm')} colocate, beta=0)" if args.use_vllm else "(no vLLM, beta=0)"),
        "versions": {k: _version(k) for k in ("trl", "vllm", "transformers")},
        "num_gpus": 1,
        "num_ranks": 1,
        "device": setup.device_name(),
        "host": socket.gethostname(),
        "started_at": started_at,
        "ended_at": time.time(),
        "tiny": args.tiny,
        "workload": vars(work) | {"steps": args.steps, "warmup": args.warmup},
        "note": (
            f"TRL {__import__('trl').__version__}: reward = "
            + ("the same GenRM judge (yatt BuiltinEngine, resident)" if judge else "constant 0")
            + f"; micro-batch {batch} x {ga} accumulation; gradient checkpointing "
            + ("off" if args.no_gradient_checkpointing else "on (trl's default)")
            + "; 'train' = step - rollout - reward"
            + (
                f"; vLLM colocate, gpu_memory_utilization {args.vllm_memory}, sleep mode "
                + ("on" if args.vllm_sleep else "off")
                + ", weight sync inside 'rollout'"
                if args.use_vllm
                else ""
            )
        ),
        "mixes": {
            "fixed": {
                "median": {"step_s": med(timed), "phases": phases, "switch_s": 0.0, "gpus": []},
                "steps": [{"step_s": s} for s in timed],
                "all_lengths_forced": forced,
            }
        },
    }
    out = Path(args.out_dir) / ("trl_vllm_1gpu.json" if args.use_vllm else "step_trl_1gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1))
    print(
        f"[{run['layout']} x1 fixed] steps {[round(s, 2) for s in step_s]} lengths forced {forced}; wrote {out}"
    )
    return out


def generation_settings(args: argparse.Namespace, work) -> dict:
    """GRPOConfig's generation fields: HF `generate` forcing 256 tokens with min_new_tokens, or
    vLLM colocate forcing them with SamplingParams(ignore_eos=True) and max_tokens = 256."""
    if not args.use_vllm:
        return {"use_vllm": False, "generation_kwargs": {"min_new_tokens": 256}}
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": args.vllm_memory,
        "vllm_enable_sleep_mode": args.vllm_sleep,
        "vllm_max_model_length": work.prompt_tokens + 256,
        "generation_kwargs": {"ignore_eos": True},
    }


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main(sys.argv[1:])
