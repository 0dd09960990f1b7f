"""The reference trainer's setup: engines, the reward, held-out rows, start checks, export.

    device = engine_device(cfg.placement, runtime.device)      the trainer's, or (separate) its own
    sync = WeightSync(engine, policy, is_lora=..., engine_device=device, ...)  a step's sync
    engine = make_engine(cfg.rollout, model_dir, device)       rollout.build_engine
    judge_engine = make_judge_engine(cfg.reward, engine, device)  its own, or the policy's base
    plan = make_plan(cfg.placement, rollout=engine, genrm=judge_engine, ...)  placement.Plan
    scorer, exact_match = make_scorer(cfg.reward, judge_engine)  genrm.build_judge
    rows = load_eval_rows(cfg, runtime, count_tokens)          this rank's held-out prompts
    export_checkpoint(cfg, step)                               `train_grpo.py --export`
    save_config(cfg)                                           out_dir/config.yaml

Everything here runs once, after grpo_preflight.preflight and before the loop (or instead of
it, for --export); the loop itself is in train_grpo.py.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from grpo_config import RESOLVED_CONFIG, RewardConfig, TrainConfig, resolved_config_values
from grpo_data import row_fields_read_by

from yatt import core, genrm, rollout
from yatt.ckpt import Checkpointer, acquire_run_lock
from yatt.placement import Plan, Role

logger = logging.getLogger("train_grpo")


class WeightSync:
    """A step's weight sync into the policy's engine: the full weights; under LoRA the adapter
    alone (the engine adds scaling B A to its base). With the built-in engine serving it
    beside its base (rollout.engine.lora_mode=beside) on the trainer's own device and the
    adapter's parameters whole in this process (not FSDP2 shards), the first call binds them
    (BuiltinEngine.bind_adapter) and each later one refreshes the binding: a few multi-tensor
    copies instead of a walk over every adapter tensor (issue 45's sync bar)."""

    def __init__(
        self, engine, policy, *, is_lora: bool, engine_device: Any, trainer_device: Any
    ) -> None:
        self._engine, self._policy, self._is_lora = engine, policy, is_lora
        self._can_bind = (
            is_lora
            and torch.device(engine_device) == torch.device(trainer_device)
            and isinstance(engine, rollout.BuiltinEngine)
            and engine.lora_mode == "beside"
            and getattr(policy.config, "parallel", None) != "fsdp2"
        )
        self._binding: rollout.AdapterBinding | None = None

    @property
    def is_bound(self) -> bool:
        return self._binding is not None

    def __call__(self) -> None:
        if self._binding is not None:
            self._binding.refresh()
        elif self._can_bind:
            self._binding = self._engine.bind_adapter(self._policy.named_adapter_weights(live=True))
            logger.info(
                "weight sync: the adapter's %d tensors bound to the engine (lora_mode=beside), "
                "refreshed in place at each step",
                self._binding.num_tensors,
            )
        elif self._is_lora:
            self._engine.update_weights(self._policy.named_adapter_weights())
        else:
            self._engine.update_weights(self._policy.named_weights())


def engine_device(placement: str, trainer_device: Any) -> str:
    """Where this rank's rollout and judge engines run. The trainer's device, except under
    placement=separate on CUDA: rank r (LOCAL_RANK) trains on GPU r and its engines take GPU
    r + LOCAL_WORLD_SIZE, so a node needs twice as many visible GPUs as ranks. The weights then
    cross between the two GPUs in the engine's update_weights (a peer copy inside this
    process, over NVLink where the GPUs have it), and nothing sleeps. On the host every role
    is on the CPU (a check of the wiring, not of speed). ValueError naming placement, before
    any model loads, when the GPUs are too few."""
    device = torch.device(trainer_device)
    if placement != "separate" or device.type != "cuda":
        return str(device)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    index = (device.index or 0) + ranks
    visible = torch.cuda.device_count()
    if index >= visible:
        raise ValueError(
            f"placement='separate' puts each rank's engines on a GPU of their own: "
            f"{ranks} rank(s) on this node need {2 * ranks} GPUs, {visible} visible "
            f"(CUDA_VISIBLE_DEVICES); start fewer ranks (torchrun --nproc_per_node), or use "
            "placement='partial' to share a GPU"
        )
    return f"cuda:{index}"


def make_engine(
    section: rollout.EngineSpec,
    model_dir: str,
    device: str,
    *,
    policy_tp_size: int | None = None,
):
    """The policy's (cfg.rollout) or the judge's (cfg.reward) engine: rollout.build_engine.
    policy_tp_size (the policy's engine only: the runtime's tp_size) is checked against a
    vLLM/SGLang engine's tensor-parallel size before its model loads."""
    return rollout.build_engine(section, model_dir, device=device, policy_tp_size=policy_tp_size)


def make_judge_engine(reward: RewardConfig, policy_engine, device: str):
    """The judge's engine: its own (reward.judge_dir, reward.engine), or, for a self-judging
    GenRM (reward.judge_dir=policy), the policy's engine with its LoRA adapter off
    (BuiltinEngine.without_adapter()): the same resident weights and the same KV cache, so
    no second copy of the model and no second cache region; its rows run in the policy's
    batches when they sample alike, else between the policy's calls. Close the engine it
    came from, not the view (its close() does nothing)."""
    if reward.shares_policy:
        logger.info(
            "reward.judge_dir=policy: the judge is the policy's base on the policy's engine "
            "(adapter off); reward.engine's settings are unused"
        )
        return policy_engine.without_adapter()
    return make_engine(reward, reward.judge_dir, device)


def is_own_judge_engine(judge_engine) -> bool:
    """A judge engine that is a placement role of its own; the policy's base view (which owns
    no memory, so has no sleep/wake_up) is not."""
    return isinstance(judge_engine, Role)


def make_plan(placement: str, *, rollout, genrm, train, reference, offload: str) -> Plan:
    """The placement plan of the run's roles (placement: "full", "partial" or "separate":
    every role awake on its own GPUs, engine_device).

    A judge on the policy's engine (make_judge_engine with reward.judge_dir=policy) is no role
    of its own: the one engine is placed as the rollout, awake through rollout and judging, and
    the plan is full colocation's rollout/train/sync (partial colocation's memory split between
    two engines has nothing to split: the judge's rows share the policy engine's slots)."""
    if placement == "separate":
        own_judge = genrm if genrm is not None and is_own_judge_engine(genrm) else None
        return Plan.separate(rollout=rollout, genrm=own_judge, train=train, reference=reference)
    if genrm is not None and not is_own_judge_engine(genrm):
        if placement == "partial":
            logger.info(
                "placement=partial with the judge on the policy's engine (reward.judge_dir="
                "policy): one engine serves both, placed as full colocation's rollout, train "
                "and sync phases; responses are still judged as they finish"
            )
        return Plan.full_colocation(
            rollout=rollout, train=train, reference=reference, offload=offload
        )
    plans = {"full": Plan.full_colocation, "partial": Plan.partial_colocation}
    return plans[placement](
        rollout=rollout, genrm=genrm, train=train, reference=reference, offload=offload
    )


def judges_while_generating(plan: Plan, judge_engine) -> bool:
    """Whether responses can go to the judge while the rollout still runs: a judge without an
    engine of its own (functions, an endpoint) or on the policy's engine always; a judge engine
    of its own when the plan keeps it resident beside the rollout's."""
    if not is_own_judge_engine(judge_engine):
        return True
    return plan.is_resident_together("rollout", "genrm")


def make_scorer(
    reward: RewardConfig, judge_engine, closeables: list[Any] | None = None
) -> tuple[Any, genrm.ExactMatch]:
    """The reward (judge + functions + rule) and the exact-match rule (an accuracy signal that
    reward.accuracy may name, computed for the metric even when unweighted):
    genrm.build_judge; what owns threads or processes goes into `closeables`."""
    return genrm.build_judge(reward, judge_engine, closeables)


def required_row_fields(cfg: TrainConfig) -> list[str]:
    """Row fields every usable row holds: what the judge's prompt reads (no judge: none)."""
    if cfg.reward.backend == "none":
        return []
    return row_fields_read_by(cfg.reward.template, cfg.data.answer_key)


def row_limits(cfg: TrainConfig) -> dict[str, Any]:
    """The loader's size limits (rows, prompts; images: opened on their rank, oversized ones
    skipped), each checked before the row, prompt or image is read whole."""
    limits: dict[str, Any] = {
        "max_row_bytes": cfg.data.max_row_bytes,
        "max_prompt_bytes": cfg.data.max_prompt_bytes or None,  # None: the loader's default
    }
    if cfg.data.image_key:
        limits |= {
            "image_key": cfg.data.image_key,
            "max_image_pixels": cfg.data.max_image_pixels,
            "max_image_bytes": cfg.data.max_image_bytes,
        }
    return limits


def load_eval_rows(
    cfg: TrainConfig, runtime: core.Runtime, count_tokens: Callable[[Any], int]
) -> list[dict]:
    """This rank's share of the held-out prompts (the file's first eval.num_prompts usable
    rows, in file order), loaded once; [] when evaluation is off."""
    if not cfg.eval.every_steps or not cfg.eval.path:
        return []
    loader = core.ShardedLoader(
        cfg.eval.path,
        batch_size=1,
        rank=runtime.dp_rank,
        world_size=runtime.dp_size,
        prompt_key=cfg.data.prompt_key,
        should_shuffle=False,
        max_prompt_tokens=cfg.rollout.max_prompt_tokens,
        count_tokens=count_tokens,
        required_keys=required_row_fields(cfg),
        **row_limits(cfg),
    )
    # One pass over this rank's shard at most: never the same prompt twice.
    num_rows = min(math.ceil(cfg.eval.num_prompts / runtime.dp_size), loader.num_local_rows)
    rows = loader.next_batch(num_rows)
    if loader.num_skipped:
        logger.warning(
            "eval.path=%r: %d rows skipped on rank %d (%s)",
            cfg.eval.path,
            loader.num_skipped,
            runtime.dp_rank,
            {cause: count for cause, count in loader.skipped_by_cause().items() if count},
        )
    return rows


def save_config(cfg: TrainConfig) -> Path:
    """The run's resolved config (paths filled, the policy's class built) as YAML in out_dir,
    replaced whole (a crash mid-write leaves the old one): what --resume and --export read
    when no --config is given, and a record of what ran."""
    out = Path(cfg.out_dir) / RESOLVED_CONFIG
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    text = "# the resolved config of this run (train_grpo.py writes it at start)\n"
    text += yaml.safe_dump(resolved_config_values(cfg), sort_keys=False, allow_unicode=True)
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, out)
    return out


def export_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.out_dir) / (cfg.export.dir or "export")


def export_checkpoint(cfg: TrainConfig, step: int | None) -> Path:
    """`train_grpo.py --export [--step N]`: the checkpoint of `step` (default the newest) under
    out_dir as a Hugging Face folder, in this one process; no model or engine starts."""
    if cfg.backend != "torch":
        raise ValueError(
            f"--export reads TorchPolicy checkpoints; backend={cfg.backend!r} checkpoints hold "
            "tensor-parallel shards: a run exports its final policy itself (export.dir)"
        )
    out = export_dir(cfg)
    if step is not None:  # an earlier step: beside the final export, never over it
        out = out.with_name(f"{out.name}-step{step}")
    # The run lock while it reads and writes: never beside a trainer of this out_dir (which
    # would be told who holds it); the checkpoints are only read, nothing in them changes.
    with (
        acquire_run_lock(cfg.out_dir, purpose="export"),
        Checkpointer(Path(cfg.out_dir) / "checkpoints", read_only=True) as ckpt,
    ):
        step = ckpt.latest() if step is None else step
        if step is None:
            raise ValueError(f"--export: {cfg.out_dir}/checkpoints holds no checkpoint")
        source = ckpt.step_path(step)
        if getattr(cfg.policy, "lora", None) is not None:
            # a LoRA checkpoint holds the adapter alone: the policy is built on its base
            # (model_dir) to load it into, then written merged and as the adapter
            runtime = core.init_runtime(seed=cfg.seed)
            policy = core.build_policy(cfg.backend, cfg.policy, runtime)
            ckpt.load(policy.state(), step=step)
            export_policy(policy, out, cfg.export.dtype or None)
        else:
            # Replaces only yatt's own earlier export there (the library refuses anything else).
            core.export_hf_from_checkpoint(
                source,
                out,
                model_dir=cfg.policy.model_dir,
                dtype=cfg.export.dtype or None,
                should_overwrite=True,
            )
    logger.info("exported step %d of %s to %s", step, source.parent, out)
    return out


def export_policy(policy: Any, out: Path, dtype: str | None) -> Path:
    """The policy as a Hugging Face folder at `out` (a LoRA policy: its adapter merged in, and
    the adapter alone in PEFT's format at out/adapter); replaces only yatt's own export."""
    out = core.export_hf(policy, out, dtype=dtype, should_overwrite=True)
    if getattr(policy.config, "lora", None) is not None:
        adapter = core.export_lora_adapter(
            policy, Path(out) / "adapter", dtype=dtype, should_overwrite=True
        )
        logger.info("the LoRA adapter, in PEFT's format: %s", adapter)
    return out


def close_all(closeables: Sequence[Any], *, should_raise: bool) -> None:
    """Close each; a failure is logged, and raised only when no earlier error is propagating."""
    errors = []
    for closeable in closeables:
        try:
            closeable.close()
        except Exception as exc:  # keep closing the rest
            logger.exception("closing %s failed", type(closeable).__name__)
            errors.append(exc)
    if errors and should_raise:
        raise errors[0]
