"""bench/step/step.py's GRPO workload in verl 0.9.1 on one GPU (colocate mode, vLLM for both engines).

    python3 bench/verl/verl_step.py --mix longtail --out-dir OUT            # GPU machine (verl_gpu.sh)
    python3 bench/verl/verl_step.py --mix fixed --judge-shape 1.5b --out-dir OUT
    python bench/verl/verl_step.py --dry-run --mix longtail --out-dir /tmp/v  # CPU: config only

The same work as yatt's layouts (_step_setup.py): the random Qwen2.5-0.5B-shaped policy and a
0.5B- (or --judge-shape 1.5B-) shaped GenRM judge saved once, 16 prompts x 8 samples per step,
prompts of 128 random letters (128 tokens), forced response lengths (`fixed` 256; `longtail`
drawn per sample as _step_setup.response_lengths draws them, the same per step), forced
128-token verdicts, one optimizer step per batch, no KL, bf16 engines.

How verl is driven (bench/verl/configs/README.md: the settings, why, and what differs):
  * verl's own entry point, `python -m verl.trainer.main_ppo` with Hydra overrides
    (verl_overrides), trainer.logger=[console,file]: verl writes each step's metrics, its
    timing_raw as timing_s/<name> among them, to a JSONL file. This driver timestamps each
    line as it lands (the step's end; its start = end - timing_s/step) and samples NVML meanwhile
    (_step_setup.GpuSampler): GPU busy fraction per step, as yatt's runs measure it.
  * The dataset is one parquet row per prompt per step, in order (data.shuffle=False); each row
    carries its group's forced lengths, the prompt text and the verdict length in extra_info.
  * The policy's prompt: verl renders chat messages with the tokenizer's chat template; yatt's
    engines take the 128 prompt ids as they are. A view of the policy directory (weights
    linked, tokenizer copied) gets a chat template that writes the content alone, so verl's
    prompt is the same 128 tokens.
  * Response lengths: bench/verl/verl_plugins.ForcedLengthAgentLoop (max_tokens + ignore_eos per
    vLLM request); the judge: bench/verl/verl_plugins.JudgeRewardManager through verl's reward loop
    with the reward model served by vLLM in colocate mode (woken after the rollout).

The run's JSON (verl_<mix>[-j<shape>]_1gpu.json) holds every step's raw timing_s and the phases
mapped onto yatt's names (verl_runs.PHASES), written by bench/verl/verl_runs.py;
bench/verl/verl_report.py puts it beside yatt's and TRL's runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
import _step_setup as setup  # bench/ is not a package
from verl_runs import parse_steps, write_run  # verl's log -> the run's JSON

BENCH = Path(__file__).resolve().parent
PLUGINS = BENCH / "verl_plugins.py"
AGENT_LOOPS = BENCH / "configs" / "agent_loops.yaml"  # registers AGENT_LOOP_NAME
AGENT_LOOP_NAME = "yatt_forced"
FUSED_KERNELS = ("off", "torch", "triton")
# A chat template that writes the messages' content and nothing else: verl's prompt ids are then
# the prompt's own 128 tokens, as yatt's engines get them.
CONTENT_ONLY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(kw_only=True, frozen=True)
class VerlBenchConfig:
    """One verl run of the workload; every field is a setting verl_overrides writes."""

    mix: str = "fixed"
    judge_shape: str = "0.5b"
    steps: int = 5
    warmup: int = 2
    judge_tokens: int = 128
    # bypass: old log-probs = vLLM's sampling log-probs (verl's rollout_correction.bypass_mode),
    # no extra forward pass, as yatt (PolicyLoss(is_on_policy=True)) and TRL (num_iterations=1)
    # run one optimizer step per batch; recompute: verl's default, one more actor forward.
    old_log_prob: str = "bypass"
    rollout_memory: float = 0.3  # vLLM's gpu_memory_utilization, as bench/step/step.py's engine
    judge_memory: float = 0.3
    micro_batch_tokens: int = 16384  # yatt's --micro-batch-tokens; verl's ppo_max_token_len
    actor_dtype: str = "fp32"  # verl's FSDP master weights (bf16 compute either way)
    # verl's fused output layer + log-prob (actor_rollout_ref.model.use_fused_kernels): "off"
    # (its default) materializes the [tokens, vocab] logits; "torch"/"triton" pick
    # fused_kernel_options.impl_backend. The first H200 run (off) spent 8.9 s of a 14.5 s step
    # in update_actor at 1.6% MFU.
    fused_kernels: str = "off"
    # verl 0.9.1's V1 sync trainer waits for the rollout by polling its replay buffer every
    # 2.0 s (ReplayBuffer's poll_interval, not in verl's config): its `gen` phase comes out as
    # 2.0x or 4.0x s. A value here plugs verl's documented custom-sampler hook
    # (trainer.v1.sampler.custom_sampler) with verl_plugins.QuickPollReplayBuffer, verl's own
    # buffer polling every poll_interval_s. None: verl's buffer as it ships.
    poll_interval_s: float | None = None
    agent_workers: int = 8  # must divide the prompt count (see verl_plugins)
    # v1: verl 0.9.1's default trainer (TransferQueue between the stages); v0: its legacy
    # ray_trainer loop, deprecated, kept as the fallback if TransferQueue fails there.
    trainer: str = "v1"
    ray_cpus: int = 64
    reward_workers: int = 8

    def __post_init__(self) -> None:
        if self.mix not in setup.MIXES:
            raise ValueError(f"VerlBenchConfig.mix={self.mix!r}: use one of {setup.MIXES}")
        if self.judge_shape not in setup.SHAPES:
            raise ValueError(
                f"VerlBenchConfig.judge_shape={self.judge_shape!r}: use one of {tuple(setup.SHAPES)}"
            )
        if self.old_log_prob not in ("bypass", "recompute"):
            raise ValueError(
                f"VerlBenchConfig.old_log_prob={self.old_log_prob!r}: use 'bypass' or 'recompute'"
            )
        if self.fused_kernels not in FUSED_KERNELS:
            raise ValueError(
                f"VerlBenchConfig.fused_kernels={self.fused_kernels!r}: use one of {FUSED_KERNELS}"
            )
        if self.trainer not in ("v1", "v0"):
            raise ValueError(f"VerlBenchConfig.trainer={self.trainer!r}: use 'v1' or 'v0'")
        if self.poll_interval_s is not None and not 0 < self.poll_interval_s <= 2.0:
            raise ValueError(
                f"VerlBenchConfig.poll_interval_s={self.poll_interval_s!r}: use a value in "
                "(0, 2.0] seconds, e.g. 0.05 (None: verl's own 2.0 s)"
            )
        if self.poll_interval_s is not None and self.trainer != "v1":
            raise ValueError(
                "VerlBenchConfig.poll_interval_s is the V1 trainer's replay buffer: the v0 "
                "trainer has none (leave it None)"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"VerlBenchConfig.steps={self.steps}, warmup={self.warmup}: need steps >= 1, "
                "warmup >= 0"
            )
        num_prompts = setup.Workload.num_prompts
        if self.agent_workers < 1 or num_prompts % self.agent_workers:
            raise ValueError(
                f"VerlBenchConfig.agent_workers={self.agent_workers}: must divide the "
                f"{num_prompts} prompts, so that a group's copies reach one agent-loop worker"
            )

    @property
    def num_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def max_response_tokens(self) -> int:
        return 256 if self.mix == "fixed" else setup.MAX_RESPONSE_TOKENS

    @property
    def variant(self) -> str:
        """The run's name: verl_<mix>, -j<shape> for another judge shape, -recompute."""
        key = f"verl_{self.mix}"
        key += f"-j{self.judge_shape}" if self.judge_shape != "0.5b" else ""
        key += "-recompute" if self.old_log_prob == "recompute" else ""
        key += "-v0" if self.trainer == "v0" else ""
        key += f"-fused-{self.fused_kernels}" if self.fused_kernels != "off" else ""
        key += f"-poll{self.poll_interval_s * 1000:g}ms" if self.poll_interval_s else ""
        return key


# -- data and models ---------------------------------------------------------------------------
def dataset_rows(cfg: VerlBenchConfig, work: setup.Workload) -> list[dict[str, Any]]:
    """One row per prompt per step, in step order: what verl's dataloader (shuffle off, batch =
    num_prompts) hands out as one step's batch."""
    rows = []
    for step in range(cfg.num_steps):
        texts = setup.prompt_texts(work, step)
        lengths = setup.response_lengths(cfg.mix, work, step)
        for p, text in enumerate(texts):
            index = step * work.num_prompts + p
            group = lengths[p * work.group_size : (p + 1) * work.group_size]
            rows.append(
                {
                    "data_source": "yatt_bench",
                    "prompt": [{"role": "user", "content": text}],
                    "ability": "bench",
                    "reward_model": {"style": "model", "ground_truth": ""},
                    "extra_info": {
                        "index": index,
                        "step": step,
                        "forced_lengths": [int(n) for n in group],
                        "prompt_text": text,
                        "judge_tokens": cfg.judge_tokens,
                    },
                }
            )
    return rows


def write_dataset(rows: list[dict[str, Any]], path: Path) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def policy_view(policy_dir: Path, out: Path) -> Path:
    """`policy_dir` with the content-only chat template: the weights linked, every other file
    copied (never linked: saving the tokenizer must not write into `policy_dir`), then the
    tokenizer saved with its new template (verl and its vLLM read this directory)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for src in policy_dir.iterdir():
        if src.name.endswith((".safetensors", ".safetensors.index.json")):
            (out / src.name).symlink_to(src.resolve())
        elif src.is_file():
            shutil.copy2(src, out / src.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.chat_template = CONTENT_ONLY_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


# -- verl's configuration ----------------------------------------------------------------------
def _fused_kernel_overrides(cfg: VerlBenchConfig) -> list[str]:
    """verl's fused output layer + log-prob, when asked for (nothing at "off": verl's default)."""
    if cfg.fused_kernels == "off":
        return []
    return [
        "actor_rollout_ref.model.use_fused_kernels=True",
        f"actor_rollout_ref.model.fused_kernel_options.impl_backend={cfg.fused_kernels}",
    ]


def _poll_overrides(cfg: VerlBenchConfig, plugins: str) -> list[str]:
    """verl's replay buffer polling every cfg.poll_interval_s (nothing when None: verl's own)."""
    if cfg.poll_interval_s is None:
        return []
    return [
        f"trainer.v1.sampler.custom_sampler.path={plugins}",
        "trainer.v1.sampler.custom_sampler.name=QuickPollReplayBuffer",
        f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={cfg.poll_interval_s}",
    ]


def _quote(value: str) -> str:
    """A Hydra override value as a quoted string (paths hold characters Hydra would parse)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def verl_overrides(
    cfg: VerlBenchConfig,
    *,
    policy_dir: Path,
    judge_dir: Path,
    data_file: Path,
    agent_loop_config: Path,
    work: setup.Workload,
    pythonpath: str = "",
) -> list[str]:
    """Hydra overrides of verl's ppo_trainer config for this run (the why of each setting:
    bench/verl/configs/README.md)."""
    prompt_len = work.prompt_tokens
    response_len = cfg.max_response_tokens
    judge_context = (
        prompt_len + setup.MAX_RESPONSE_TOKENS + setup.JUDGE_TEMPLATE_TOKENS + cfg.judge_tokens
    )
    slots = work.num_samples
    bypass = cfg.old_log_prob == "bypass"
    plugins = _quote(str(PLUGINS))
    out = [
        # GRPO, no KL anywhere, one optimizer step per batch
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.norm_adv_by_std_in_grpo=True",
        f"algorithm.rollout_correction.bypass_mode={bypass}",
        # data: one step = num_prompts rows, in order
        f"data.train_files={_quote(str(data_file))}",
        f"data.val_files={_quote(str(data_file))}",
        f"data.train_batch_size={work.num_prompts}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={response_len}",
        "data.shuffle=False",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        # the policy: same weights, content-only chat template; no activation checkpointing
        # (yatt's TorchPolicy runs without); SDPA on micro-batches padded to their longest
        # sample, as yatt's TorchPolicy: verl's padding-free path needs flash-attn (its default
        # attention), which the machine lacks and no wheel for torch 2.11 + CUDA 13 is carried
        f"actor_rollout_ref.model.path={_quote(str(policy_dir))}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={work.num_prompts}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={cfg.micro_batch_tokens}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        f"actor_rollout_ref.actor.fsdp_config.model_dtype={cfg.actor_dtype}",
        *_fused_kernel_overrides(cfg),
        # the rollout: vLLM, one GPU, sleeping between rollouts (colocate)
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={work.group_size}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={cfg.rollout_memory}",
        f"actor_rollout_ref.rollout.max_num_seqs={slots}",
        f"actor_rollout_ref.rollout.max_model_len={prompt_len + response_len}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        "actor_rollout_ref.rollout.ignore_eos=True",
        f"actor_rollout_ref.rollout.calculate_log_probs={bypass}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={cfg.micro_batch_tokens}",
        f"actor_rollout_ref.rollout.agent.num_workers={cfg.agent_workers}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP_NAME}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={_quote(str(agent_loop_config))}",
        # the judge: verl's reward loop, reward model served by vLLM in the actor's pool
        f"reward.num_workers={cfg.reward_workers}",
        f"reward.custom_reward_function.path={plugins}",
        "reward.custom_reward_function.name=compute_score",
        "reward.reward_manager.source=importlib",
        "reward.reward_manager.name=JudgeRewardManager",
        f"reward.reward_manager.module.path={plugins}",
        "reward.reward_model.enable=True",
        "reward.reward_model.enable_resource_pool=False",
        f"reward.reward_model.model_path={_quote(str(judge_dir))}",
        "reward.reward_model.rollout.name=vllm",
        "reward.reward_model.rollout.dtype=bfloat16",
        "reward.reward_model.rollout.tensor_model_parallel_size=1",
        f"reward.reward_model.rollout.gpu_memory_utilization={cfg.judge_memory}",
        "reward.reward_model.rollout.enforce_eager=False",
        "reward.reward_model.rollout.free_cache_engine=True",
        f"reward.reward_model.rollout.max_num_seqs={slots}",
        f"reward.reward_model.rollout.max_model_len={judge_context}",
        "reward.reward_model.rollout.max_num_batched_tokens=16384",
        f"reward.reward_model.rollout.prompt_length={judge_context - cfg.judge_tokens}",
        f"reward.reward_model.rollout.response_length={cfg.judge_tokens}",
        "reward.reward_model.rollout.skip_tokenizer_init=False",
        # the trainer: one GPU, every step timed by verl, nothing else in the loop
        f"trainer.use_v1={cfg.trainer == 'v1'}",
        "trainer.v1.trainer_mode=sync",
        *_poll_overrides(cfg, plugins),
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={cfg.num_steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=yatt_bench",
        f"trainer.experiment_name={cfg.variant}",
        # Ray: no dashboard (its extras are not carried); the bench's path and the NVLink
        # multicast switches in every actor's environment (the device README asks for them)
        "+ray_kwargs.ray_init.include_dashboard=False",
        # Logical CPUs for Ray's placement: verl starts ~30 mostly idle actors (agent-loop,
        # reward and TransferQueue workers, servers, routers), each holding one CPU while
        # placed; the machine's 16 cores would leave some pending forever.
        f"ray_kwargs.ray_init.num_cpus={cfg.ray_cpus}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_NVLS_ENABLE='0'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.TORCH_SYMM_MEM_DISABLE_MULTICAST='1'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.NVSHMEM_DISABLE_NVLS='1'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.YATT_JUDGE_TOKENS='{cfg.judge_tokens}'",
    ]
    if pythonpath:
        out.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={_quote(pythonpath)}")
    return out


def compose(overrides: list[str]):
    """verl's ppo_trainer config with `overrides`, as Hydra composes it for main_ppo, checked as
    verl checks it before training: validate_config (main_ppo's TaskRunner), and the sections
    verl turns into its dataclasses (omega_conf_to_dataclass: their __post_init__ checks)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    for section in (
        config.actor_rollout_ref.model,
        config.actor_rollout_ref.actor,
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.rollout.checkpoint_engine,
        config.reward.reward_model.rollout,
        config.algorithm,
    ):
        omega_conf_to_dataclass(section)
    return config


# -- a run -------------------------------------------------------------------------------------
class LineClock:
    """Follows a JSONL file as verl appends to it; each line's arrival time (perf_counter)."""

    def __init__(self, path: Path, period_s: float = 0.05) -> None:
        self.path, self.period_s = path, period_s
        self.lines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="verl-lines", daemon=True)

    def start(self) -> LineClock:
        self._thread.start()
        return self

    def _loop(self) -> None:
        offset, buffer = 0, ""
        while True:
            stopping = self._stop.is_set()
            if self.path.is_file():
                with self.path.open() as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                now = time.perf_counter()
                buffer += chunk
                *complete, buffer = buffer.split("\n")
                self.lines += [(now, line) for line in complete if line.strip()]
            if stopping:
                return
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_in_own_group(cmd: list[str], *, env: dict, log, timeout_s: float | None) -> int:
    """Run verl in a process group of its own and end that whole group (verl's Ray workers and
    engine servers are its children) on a timeout or when this process is told to stop: a
    leftover vLLM server would hold GPU memory through the next run of the device call."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )

    def end_group(*_):
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
                return

    previous = signal.signal(signal.SIGTERM, lambda *a: (end_group(), sys.exit(143)))
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_group()
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            end_group()


def run(
    cfg: VerlBenchConfig,
    *,
    model_dir: Path,
    out_dir: Path,
    dry_run: bool,
    timeout_s: float | None = None,
) -> Path:
    started_at = time.time()
    work = setup.Workload(judge_tokens=cfg.judge_tokens)
    shapes = ("0.5b", cfg.judge_shape)
    work_dir = out_dir / f"{cfg.variant}_work"
    work_dir.mkdir(parents=True, exist_ok=True)
    data_file = write_dataset(dataset_rows(cfg, work), work_dir / "train.parquet")
    # Dry run: 2-layer models (verl's model config reads their config and tokenizer).
    policy_dir, judge = setup.make_models(model_dir, tiny=dry_run, shapes=shapes)
    policy = policy_view(policy_dir, model_dir / "policy_verl")
    pythonpath = os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]).rstrip(":")
    overrides = verl_overrides(
        cfg,
        policy_dir=policy,
        judge_dir=judge,
        data_file=data_file,
        agent_loop_config=AGENT_LOOPS,
        work=work,
        pythonpath=pythonpath,
    )
    (work_dir / "overrides.txt").write_text("\n".join(overrides) + "\n")
    if dry_run:
        compose(overrides)
        print(f"[verl dry-run {cfg.variant}] {len(overrides)} overrides compose and validate")
        return work_dir / "overrides.txt"

    log_path = work_dir / "metrics.jsonl"
    log_path.unlink(missing_ok=True)
    env = dict(
        os.environ,
        VERL_FILE_LOGGER_PATH=str(log_path),
        PYTHONPATH=pythonpath,
        YATT_JUDGE_TOKENS=str(cfg.judge_tokens),
    )
    sampler = setup.GpuSampler([setup.physical_gpu(0)]).start()
    clock = LineClock(log_path).start()
    try:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
        with (work_dir / "verl.log").open("w") as log:
            rc = run_in_own_group(cmd, env=env, log=log, timeout_s=timeout_s)
    finally:
        clock.stop()
        sampler.stop()
    rows = parse_steps(clock.lines)
    if rc != 0 or len(rows) < cfg.num_steps:
        tail = (work_dir / "verl.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"verl exited {rc} after {len(rows)} steps; log tail:\n{tail}")
    for row in rows:
        row["gpus"] = sampler.window(row["t0"], row["t1"])
        row["is_warmup"] = row["step"] <= cfg.warmup
    return write_run(cfg, rows, out_dir, work, started_at=started_at)


def parse_args(argv: list[str]) -> tuple[VerlBenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", choices=setup.MIXES, default="fixed")
    p.add_argument("--judge-shape", choices=tuple(setup.SHAPES), default="0.5b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--judge-tokens", type=int, default=128)
    p.add_argument("--old-log-prob", choices=("bypass", "recompute"), default="bypass")
    p.add_argument("--rollout-memory", type=float, default=0.3)
    p.add_argument("--judge-memory", type=float, default=0.3)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--actor-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--fused-kernels", choices=FUSED_KERNELS, default="off", help="verl's fused log-prob head"
    )
    p.add_argument("--trainer", choices=("v1", "v0"), default="v1", help="verl's trainer loop")
    p.add_argument(
        "--poll-interval-s",
        type=float,
        default=None,
        help="the V1 trainer's replay-buffer poll (verl's own: 2.0 s, fixed), e.g. 0.05",
    )
    p.add_argument("--model-dir", default=None, help="bench/step/step.py's saved models")
    p.add_argument("--out-dir", default="bench/results/step_runs")
    p.add_argument("--dry-run", action="store_true", help="compose and validate the config only")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds for verl's run; then its group ends"
    )
    args = p.parse_args(argv)
    cfg = VerlBenchConfig(
        mix=args.mix,
        judge_shape=args.judge_shape,
        steps=args.steps,
        warmup=args.warmup,
        judge_tokens=args.judge_tokens,
        old_log_prob=args.old_log_prob,
        rollout_memory=args.rollout_memory,
        judge_memory=args.judge_memory,
        micro_batch_tokens=args.micro_batch_tokens,
        actor_dtype=args.actor_dtype,
        fused_kernels=args.fused_kernels,
        trainer=args.trainer,
        poll_interval_s=args.poll_interval_s,
    )
    if args.model_dir is None:
        name = "yatt-step" + ("" if cfg.judge_shape == "0.5b" else f"-0.5b-{cfg.judge_shape}")
        args.model_dir = str(Path(os.environ.get("TMPDIR", "/tmp")) / name)
    return cfg, args


def main(argv: list[str]) -> None:
    cfg, args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        run(
            cfg,
            model_dir=Path(args.model_dir),
            out_dir=out_dir,
            dry_run=args.dry_run,
            timeout_s=args.timeout,
        )
    finally:
        if not args.dry_run:
            shutil.rmtree(out_dir / f"{cfg.variant}_work" / "ckpt", ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
