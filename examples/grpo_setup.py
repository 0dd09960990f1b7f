"""The reference trainer's setup: engines, the reward, held-out rows, start checks, export.

    engine = make_engine(cfg.rollout, model_dir, device)       built-in, vLLM or SGLang
    scorer, exact = make_scorer(cfg.reward, judge_engine)      judge (+ functions, + rule)
    parser = verdict_parser(cfg.reward)                        the judge's verdict format
    rows = load_eval_rows(cfg, runtime, count_tokens)          this rank's held-out prompts
    export_checkpoint(cfg, step)                               `train_grpo.py --export`

Everything here runs once, after grpo_preflight.preflight and before the loop (or instead of
it, for --export); the loop itself is in train_grpo.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpo_config import (
    ENGINE_CONFIGS,
    LOCAL_JUDGES,
    VERDICT_PARSERS,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from grpo_data import row_fields_read_by

from yatt import core, genrm, rollout
from yatt.ckpt import Checkpointer, acquire_run_lock

logger = logging.getLogger("train_grpo")
ENGINES = {"vllm": rollout.VLLMEngine, "sglang": rollout.SGLangEngine}


def make_engine(
    section: RolloutConfig | RewardConfig,
    model_dir: str,
    device: str,
    *,
    policy_tp_size: int | None = None,
):
    """The policy's or the judge's engine: built-in by default, vLLM or SGLang by config (its
    backend and options were checked when the config was built). policy_tp_size (the policy's
    engine only: the ranks sharing a batch, the runtime's tp_size): a vLLM/SGLang engine's
    tensor-parallel size must equal it, checked before its model loads (the built-in engine
    serves one rank)."""
    if section.backend == "builtin":
        return rollout.BuiltinEngine(model_dir, config=replace(section.engine, device=device))
    config = ENGINE_CONFIGS[section.backend](**section.backend_options)
    return ENGINES[section.backend](model_dir, config=config, policy_tp_size=policy_tp_size)


def make_scorer(
    reward: RewardConfig, judge_engine, closeables: list[Any] | None = None
) -> tuple[Any, genrm.ExactMatch]:
    """The reward: the judge's verdict, read from its last line by reward.verdict_parser (the
    default yes/no: in [-1, 1], 2 P(Yes) - 1 from a local engine's label probabilities, +1/-1
    from the text; a local engine, a served endpoint, or none), plus the reward functions and,
    when rule_weight > 0, an exact-match rule. The exact match is also the accuracy metric's
    ground truth. What owns threads goes into `closeables` (the judge engine is the caller's)."""
    sampling = rollout.SamplingParams(
        temperature=float(reward.votes > 1), max_new_tokens=reward.verdict_max_tokens
    )
    judge: Any = None
    if reward.backend in LOCAL_JUDGES:
        # The declared verdict: the judge's last line (the embedded judge answers "Yes"/"No"
        # alone, that line); a yes/no label's probability there is the reward unless "text".
        judge = genrm.GenRM(
            judge_engine,
            template=reward.template,
            parser=verdict_parser(reward),
            verdict_from=reward.verdict_from,
            votes=reward.votes,
            sampling=sampling,
            batching=reward.batching_config(),
        )
    elif reward.backend == "openai":
        judge = genrm.OpenAIJudge(
            reward.openai_config(),
            template=reward.template,
            parser=verdict_parser(reward),
            votes=reward.votes,
            sampling=sampling,
        )
        judge.check_endpoint()  # unreachable, refused key, unknown model: fail before training
    exact = genrm.ExactMatch()
    rules: list[tuple[Any, float]] = load_functions(reward)
    owned = [function for function, _ in rules]
    if reward.rule_weight:
        rules.append((exact, reward.rule_weight))
    scorer = genrm.CombinedRM(judge, rules) if rules else judge
    if rules:
        owned.append(scorer)
    if closeables is not None:
        closeables.extend(owned)
    return scorer, exact


def load_functions(reward: RewardConfig) -> list[tuple[genrm.RewardFunction, float]]:
    """reward.functions, each with its weight; they own worker processes: close() them."""
    timeout_s = reward.function_timeout_s or None
    return [
        (genrm.load_reward_function(spec, timeout_s=timeout_s), weight)
        for spec, weight in zip(reward.functions, reward.function_weights, strict=True)
    ]


def verdict_parser(reward: RewardConfig) -> genrm.VerdictParser:
    """reward.verdict_parser: a built-in format with reward.verdict_parser_options, or the
    object a "module:name" / "file.py:name" spec names (a parser, or a callable making one)."""
    name = reward.verdict_parser
    if name in VERDICT_PARSERS:
        return VERDICT_PARSERS[name](**reward.verdict_parser_options)
    parser = load_object(name, field="reward.verdict_parser")
    if isinstance(parser, type) or (callable(parser) and not hasattr(parser, "parse")):
        parser = parser()  # a class or a factory: the parser it makes
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(
            f"reward.verdict_parser={name!r} gives a {type(parser).__name__}, not a verdict "
            "parser: name an object with parse(text) -> float | None (genrm.VerdictParser), "
            "or a callable returning one"
        )
    return parser


def load_object(spec: str, *, field: str) -> Any:
    """The object at "module:name" (imported) or "path/file.py:name" (run once per process,
    as the module of its file's name); `name` may be dotted. ValueError naming `field`."""
    source, _, attr = spec.rpartition(":")
    try:
        if source.endswith(".py") or "/" in source:
            path = Path(source).expanduser().resolve()
            module_name = f"_yatt_verdict_parser_{path.stem}"
            module = sys.modules.get(module_name)
            if module is None:
                if not path.is_file():
                    raise ValueError(f"no such file {str(path)!r}")
                file_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(file_spec)
                sys.modules[module_name] = module
                try:
                    file_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(source)
        found: Any = module
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{field}={spec!r}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed while loading
        raise ValueError(
            f"{field}={spec!r}: loading it failed ({type(exc).__name__}: {exc})"
        ) from None
    return found


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
