"""The reference trainer's preflight: what the config's values point at, checked once, first in
main, before any model loads (grpo_config.py checks the values themselves and touches nothing).

    cfg, args = read_config(argv)                        values, typed and range-checked
    cfg = preflight(cfg, should_resume=args.resume)      the run's config, resolved:

    installed   vLLM/SGLang for rollout.backend and reward.backend; wandb for log.wandb_project
    reward      reward.functions import (and fit their signature); a "module:name"
                reward.verdict_parser imports; the endpoint's key (reward.openai.api_key_env)
    paths       Hub ids -> their local snapshots (never downloaded); data/eval splits exist;
                a given policy.model_dir builds the policy's config (its range checks too)
    run         export.dir replaceable; --resume has a checkpoint, a fresh run has none
    embedded    empty paths: the embedded task (examples/tasks/) built under out_dir, once
    data        images need a policy that takes them; the judge's prompt fits its context

It returns the config with every path filled and cfg.policy built as its backend's config
class; run it once per config (main does).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from grpo_config import EMBEDDED_TASKS, RewardConfig, TrainConfig, policy_field
from grpo_data import check_judge_prompts, prompt_token_counter
from grpo_prompts import check_takes_images
from grpo_setup import required_row_fields, row_limits
from transformers import AutoTokenizer

from yatt import core, genrm, rollout
from yatt.ckpt import Checkpointer

logger = logging.getLogger("train_grpo")


def preflight(
    cfg: TrainConfig, *, should_resume: bool | None = None, should_check_data: bool = True
) -> TrainConfig:
    """`cfg` checked against the world and resolved (see the module doc). should_resume: a
    run starting (False) or resuming (True) checks out_dir's checkpoints; None (`--export`,
    a config check) does not. should_check_data=False (`--export`) skips the data's checks.
    Each problem is a ValueError naming the field and the fix."""
    # Your own run's paths and reward given (task=''), and the data where it says: seconds,
    # before anything is built (the embedded task's tiny models take minutes).
    cfg.check_own_run(should_check_data=should_check_data)
    check_policy_device(cfg.backend)
    if should_check_data:
        check_data_paths(cfg)
    cfg = with_lora_engine(cfg)
    check_self_judge(cfg)
    for name, section in (("rollout", cfg.rollout), ("reward", cfg.reward)):
        check_engine_installed(name, section)
    core.check_wandb(cfg.log.wandb_project)
    check_reward(cfg.reward)
    cfg = with_local_paths(cfg)
    model_dir = policy_field(cfg.policy, "model_dir")
    if model_dir:  # the policy config's own checks, before anything is built
        build_policy_config(cfg, model_dir)
    check_export(cfg, model_dir=model_dir or None)
    if should_resume is not None:
        check_checkpoints(cfg.out_dir, should_resume)
    # --export of a given policy (should_check_data=False) needs nothing of the embedded task
    if cfg.needs_embedded_task and (should_check_data or not model_dir):
        cfg = with_embedded_task(cfg)
    policy = build_policy_config(cfg, policy_field(cfg.policy, "model_dir"))
    cfg = dataclasses.replace(cfg, policy=policy)
    if cfg.data.image_key:  # an image dataset needs a policy that takes images
        check_takes_images(cfg.policy.model_dir, cfg.data.image_key)
    if should_check_data and (cfg.uses_judge_model or not cfg.data.image_key):
        # the data's first rows through the policy's tokenizer: a file whose prompts are all
        # too long (or all unusable) fails now, naming the fields that set the limit
        rows = first_data_rows(cfg)
        if cfg.uses_judge_model:
            check_judge_prompt_lengths(cfg, rows)
    return cfg


def check_policy_device(backend: str) -> None:
    """backend=megatron needs CUDA: refused here, before the runtime and its process groups
    start, instead of when the policy is built."""
    if backend == "megatron" and not torch.cuda.is_available():
        raise ValueError(
            "backend='megatron' needs CUDA (megatron-core calls CUDA directly) and no GPU is "
            "visible here: use backend=torch on this machine"
        )


def with_lora_engine(cfg: TrainConfig) -> TrainConfig:
    """policy.lora syncs only the adapter each step: the built-in engine applies it in place;
    vLLM and SGLang serve it through their LoRA APIs, so their engine is built with what that
    needs (enable_lora, max_lora_rank, SGLang's lora_target_modules: filled into
    rollout.backend_options). A LoRA the engine cannot take (modules_to_save, a rank over its
    maximum, target modules it does not adapt) is refused here, before any model loads.
    The built-in engine under rollout.engine.lora_mode=beside gets the adapter's rank and
    targets, so its first compile already holds the adapter (EngineSpec.with_lora)."""
    lora = policy_field(cfg.policy, "lora")
    if lora is None:
        return cfg
    if not isinstance(lora, core.LoraConfig):
        lora = core.LoraConfig(**lora)  # its own range checks; unknown keys fail as TypeError
    served = cfg.rollout.with_lora(
        rank=lora.rank,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save,
        lora_field="policy.lora",
    )
    if served is cfg.rollout:  # the built-in engine merging the adapter: nothing to add
        return cfg
    given = cfg.rollout.backend_options
    added = {k: v for k, v in served.backend_options.items() if given.get(k) != v}
    if added:
        logger.info("policy.lora: rollout.backend_options gains %s to serve the adapter", added)
    if served.engine != cfg.rollout.engine:
        logger.info(
            "policy.lora: rollout.engine.max_lora_rank=%s, lora_target_modules=%r, "
            "lora_modules_to_save=%r (lora_mode=beside: the adapter's buffers made with the "
            "engine)",
            served.engine.max_lora_rank,
            served.engine.lora_target_modules,
            served.engine.lora_modules_to_save,
        )
    return dataclasses.replace(cfg, rollout=served)


def check_self_judge(cfg: TrainConfig) -> None:
    """reward.judge_dir=policy (a self-judging GenRM on the policy's engine, adapter off):
    the combinations that cannot serve it, refused before any model loads."""
    if not (cfg.uses_judge_model and cfg.reward.shares_policy):
        return
    if policy_field(cfg.policy, "lora") is None:
        raise ValueError(
            "reward.judge_dir='policy' with policy.lora=null: with full fine-tuning the "
            "policy's weights change every step, so no frozen base is resident to judge with; "
            "set policy.lora (the judge reads the base under the adapter), or give the judge a "
            "frozen copy: reward.judge_dir=<the policy's model folder>"
        )
    if cfg.rollout.backend != "builtin":
        raise ValueError(
            f"reward.judge_dir='policy' with rollout.backend={cfg.rollout.backend!r}: the "
            "judge runs on the policy's built-in engine with the adapter off; use "
            "rollout.backend=builtin"
        )
    if cfg.rollout.engine.lora_mode != "beside":
        raise ValueError(
            f"reward.judge_dir='policy' with rollout.engine.lora_mode="
            f"{cfg.rollout.engine.lora_mode!r}: a merged adapter cannot be off for the judge's "
            "rows only; set rollout.engine.lora_mode=beside"
        )
    if cfg.data.image_key:
        raise ValueError(
            f"reward.judge_dir='policy' with data.image_key={cfg.data.image_key!r}: the "
            "per-row adapter gate (rollout.engine.lora_mode=beside) serves text models only; "
            "give the judge its own model folder"
        )
    if cfg.rollout.max_staleness >= 1:
        raise ValueError(
            f"reward.judge_dir='policy' with rollout.max_staleness={cfg.rollout.max_staleness}: "
            "off-policy steps place the rollout and the judge as separate resident roles, and a "
            "self-judge is the rollout engine itself; set rollout.max_staleness=0 or give the "
            "judge its own model folder"
        )


def check_data_paths(cfg: TrainConfig) -> None:
    """data.path and eval.path, where given, exist (a typo is reported now, not after the
    models load)."""
    for name, path in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):
        if path and not Path(path).exists():
            raise ValueError(
                f"{name}={path!r}: no such file or folder (relative paths start at "
                f"{str(Path.cwd())!r})"
            )


def check_engine_installed(name: str, section: rollout.EngineSpec) -> None:
    """A vLLM/SGLang engine the section names is installed (the built-in one always is)."""
    section.check_installed()


def check_reward(reward: RewardConfig) -> None:
    """The reward's code and keys (genrm.check_judge_resources): each reward function loaded
    once, the verdict parser built, the endpoint's API key set."""
    genrm.check_judge_resources(reward)


def with_local_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with policy.model_dir and reward.judge_dir as local folders (a Hub id looked up
    in the Hugging Face cache, never downloaded) and data/eval paths at their split."""
    policy = cfg.policy
    if isinstance(policy, dict) and policy.get("model_dir"):
        policy = {**policy, "model_dir": local_model_dir("policy.model_dir", policy["model_dir"])}
    reward = cfg.reward
    if reward.judge_dir and not reward.shares_policy:
        judge_dir = local_model_dir("reward.judge_dir", reward.judge_dir)
        reward = dataclasses.replace(reward, judge_dir=judge_dir)
    data = cfg.data
    if data.split:
        data = dataclasses.replace(data, path=split_path("data", data.path, data.split), split="")
    eval_ = cfg.eval
    if eval_.split:
        eval_ = dataclasses.replace(
            eval_, path=split_path("eval", eval_.path, eval_.split), split=""
        )
    return dataclasses.replace(cfg, policy=policy, reward=reward, data=data, eval=eval_)


def local_model_dir(name: str, value: str) -> str:
    try:
        return str(core.resolve_model_dir(value))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def split_path(section: str, path: str, split: str) -> str:
    """path/split for a DatasetDict saved with save_to_disk; a clear error naming its splits."""
    root = Path(path)
    if not (root / split).is_dir():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ValueError(
            f"{section}.split={split!r}: {path!r} has no such split folder; it has {splits}"
        )
    return str(root / split)


def build_policy_config(cfg: TrainConfig, model_dir: str):
    """The backend's policy config class from cfg.policy's checked fields, its temperature
    rollout.temperature (its own range checks run here: it reads model_dir)."""
    if not isinstance(cfg.policy, dict):
        return cfg.policy  # already built
    values = {**cfg.policy, "model_dir": model_dir, "temperature": cfg.rollout.temperature}
    return core.policy_config_from_dict(cfg.backend, values)


def check_export(cfg: TrainConfig, *, model_dir: str | None) -> None:
    """An existing export.dir is replaced at the end only if it is yatt's own earlier export
    (or empty): anything else is refused now, not after the whole run."""
    if not cfg.export.dir:
        return
    try:
        core.check_export_dir(
            Path(cfg.out_dir) / cfg.export.dir,
            should_overwrite=True,
            model_dir=model_dir,
            checkpoint_dir=Path(cfg.out_dir) / "checkpoints",
        )
    except ValueError as exc:
        raise ValueError(f"export.dir={cfg.export.dir!r}: {exc}") from None


def check_checkpoints(out_dir: str, should_resume: bool) -> None:
    """--resume needs a checkpoint; a fresh run never mixes with one."""
    with Checkpointer(Path(out_dir) / "checkpoints", read_only=True) as ckpt:
        latest = ckpt.latest()
    if should_resume and latest is None:
        raise ValueError(
            f"--resume: {out_dir}/checkpoints holds no checkpoint; run without --resume to "
            "start fresh, or point out_dir at the run to continue"
        )
    if not should_resume and latest is not None:
        raise ValueError(f"out_dir={out_dir!r} has checkpoints: pass --resume or a new out_dir")


def with_embedded_task(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its empty paths at the embedded task, built under out_dir once (the judge
    fitted on reward.template), then reused."""
    from tasks import build_task  # only when asked for: it trains tiny models (yatt-testing)

    task = EMBEDDED_TASKS[cfg.task]
    workdir = Path(cfg.out_dir) / task.folder
    paths = build_task(cfg.task, workdir, cfg.reward.template)
    data, eval_, reward = cfg.data, cfg.eval, cfg.reward
    policy = cfg.policy
    if isinstance(policy, dict) and not policy.get("model_dir"):
        policy = {**policy, "model_dir": str(paths["policy"])}
    if not data.path:
        # the embedded rows, with their pictures; its held-out split unless eval.path is given
        image_key = data.image_key or task.image_key
        data = dataclasses.replace(data, path=str(paths["prompts"]), image_key=image_key)
        if not eval_.path:
            eval_ = dataclasses.replace(eval_, path=str(paths["eval"]))
    if cfg.uses_judge_model and not reward.judge_dir:
        reward = dataclasses.replace(reward, judge_dir=str(paths["judge"]))
    return dataclasses.replace(cfg, policy=policy, data=data, eval=eval_, reward=reward)


def first_data_rows(cfg: TrainConfig) -> list[dict]:
    """The data's first usable rows (the same on every rank), prompts counted by the policy's
    tokenizer. None usable: a ValueError naming the causes, the prompt limit by its fields."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_dir)
    limit = cfg.rollout.max_prompt_tokens
    try:
        return core.ShardedLoader(
            cfg.data.path,
            batch_size=1,
            prompt_key=cfg.data.prompt_key,
            should_shuffle=False,
            max_prompt_tokens=limit,
            count_tokens=prompt_token_counter(tokenizer, cfg.data.apply_chat_template),
            required_keys=required_row_fields(cfg),
            **row_limits(cfg),
        ).first_rows()
    except ValueError as exc:
        message = str(exc)
        if f"max_prompt_tokens={limit}" not in message:
            raise
        # the loader's name for the limit is no config field: say which fields set it
        fields_ = (
            f"rollout.engine.max_seq_len - rollout.max_new_tokens = "
            f"{cfg.rollout.engine.max_seq_len} - {cfg.rollout.max_new_tokens} = {limit} tokens"
        )
        raise ValueError(
            f"data.path={cfg.data.path!r}: "
            + message.replace(f"max_prompt_tokens={limit}", fields_)
            + "; raise rollout.engine.max_seq_len or lower rollout.max_new_tokens"
        ) from None


def check_judge_prompt_lengths(cfg: TrainConfig, rows: list[dict]) -> None:
    """The judge's prompt for the data's first usable rows (the same on every rank), rendered
    before any model loads: one that cannot fit the judge's context with a full-length
    response fails here, instead of turning every verdict of the run into an error."""
    is_judge_builtin = cfg.reward.backend == "builtin"
    # A self-judge (reward.judge_dir=policy) is the policy's model on the policy's engine.
    judge_dir = cfg.policy.model_dir if cfg.reward.shares_policy else cfg.reward.judge_dir
    engine = cfg.rollout.engine if cfg.reward.shares_policy else cfg.reward.engine
    check_judge_prompts(
        cfg.reward.template,
        rows,
        tokenizer=AutoTokenizer.from_pretrained(judge_dir),
        # GenRM's own limit for the built-in engine; vLLM/SGLang read the model's context.
        max_prompt_tokens=engine.max_seq_len - 1 if is_judge_builtin else None,
        max_response_tokens=min(
            cfg.rollout.max_new_tokens, cfg.reward.template.max_response_tokens
        ),
        prompt_key=cfg.data.prompt_key,
        answer_key=cfg.data.answer_key,
        source=f"data.path={cfg.data.path!r}",
    )
