"""The reference trainer's multi-turn rollout kind (rollout.environment or rollout.tools set).

    ctx.multiturn = make_multiturn(cfg, engine, tokenizer, resources)  tools in worker processes
    batch, sampling_stats = rollout_multiturn(step, ctx, stats)        ROLLOUTS["multiturn"]
    row = env_row(prompt, cfg, step=step)    what an environment's reset(**row) gets

Each row runs as samples_per_prompt trajectories, judged over the whole trajectory plus the
environment's reward and kept as whole groups (grpo_rollout.keep), in rounds or as a stream.
Off-policy steps run the same trajectories in worker threads (grpo_offpolicy.py, its rows from
env_row here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from grpo_config import TrainConfig, policy_field
from grpo_data import Scored
from grpo_metrics import StepStats
from grpo_prompts import Prompt
from grpo_rollout import RolloutContext, derived_seed, keep, take_batch, timed

from yatt import core, genrm, rollout
from yatt.ckpt import ClosingStack
from yatt.placement import PendingLoad

# The row field a multi-turn environment's reset(**row) reads its seed from: derived from
# (seed, step, row), or (seed, row) off-policy, so a resumed run gives its environments the same
# seeds.
ENV_SEED_KEY = "env_seed"


def env_row(prompt: Prompt, cfg: TrainConfig, *, step: int | None) -> dict:
    """What reset(**row) gets: the prompt's row fields (its prompt as "prompt", or "messages"
    for a message list; with the row's images (data.image_key), "messages" whose first user
    turn starts with one image part per image, as the single-turn prompt shows them) and
    ENV_SEED_KEY from (seed, step, the row's index in the data set). step
    None (off-policy steps): from (seed, the row's index) alone, since neither the step that
    trains a row nor the version it starts under is known again on resume (a re-queued
    prompt restarts under the resumed version); a row's environment then has the same seed
    in every epoch, as it has the same fields, while its sampling seed moves with the
    version."""
    row = prompt.row
    fields = {key: value for key, value in row.items() if key != core.ROW_INDEX_KEY}
    question = row[cfg.data.prompt_key]
    if prompt.images:
        fields["messages"] = messages_with_images(question, prompt.images)
    else:
        fields["messages" if isinstance(question, list) else "prompt"] = question
    index = int(row.get(core.ROW_INDEX_KEY, 0))
    if step is None:
        fields[ENV_SEED_KEY] = derived_seed(cfg.seed, index * 101, 11)
    else:
        fields[ENV_SEED_KEY] = derived_seed(cfg.seed, step * 1_000_033, index * 101, 7)
    return fields


def messages_with_images(question: str | list[dict], images: Sequence[Any]) -> list[dict]:
    """The question as messages whose first user turn starts with one image part per image
    (the picture itself: the multi-turn driver expands its placeholder), then its text."""
    messages = question if isinstance(question, list) else [{"role": "user", "content": question}]
    messages = [dict(message) for message in messages]
    first_user = next((m for m in messages if m["role"] == "user"), messages[0])
    text = first_user["content"]
    parts = text if isinstance(text, list) else [{"type": "text", "text": text}]
    first_user["content"] = [{"type": "image", "image": image} for image in images] + parts
    return messages


def rollout_multiturn(
    step: int, ctx: RolloutContext, stats: StepStats
) -> tuple[core.Batch, dict[str, float]]:
    """rollout.environment or rollout.tools set: each row run as samples_per_prompt multi-turn
    trajectories (ctx.multiturn, yatt.rollout.MultiTurnRollout: tools in worker processes, the
    engine keeping each conversation's KV between turns), reward.* over each trajectory + the
    environment's get_reward(), kept as whole groups with reward variance.
      rounds  as rollout_in_rounds: every trajectory ends inside its round (nothing in flight at
              a checkpoint); the rollout and judge resident together (placement=partial, or a
              judge without an engine): each trajectory judged as soon as it ends while the
              others are in their tool loops; else the judge after the round's rollout
      stream  (placement=partial) genrm.TrajectoryStream: rows keep entering as the sampler
              asks, each trajectory judged as it ends, each whole group kept at once, and once
              every rank is full the trajectories still running are cut (dropped, counted)
    Each row's environment gets row["env_seed"] from (seed, step, row index), the same on
    a resumed run. Adds the multi-turn counts (MultiTurnStats.as_metrics: tool calls, errors by
    cause, turns, end causes), summed over ranks, to the sampling stats
    (dynamic_sampling/multiturn/*)."""
    cfg = ctx.cfg
    turn_stats = rollout.MultiTurnStats()
    stream_stats: dict[str, float] = {}
    if cfg.rollout.sampling_mode == "stream":
        stream = genrm.TrajectoryStream(
            multiturn=ctx.multiturn,
            scorer=ctx.scorer,
            sampling=ctx.sampling(step, 0),
            to_row=lambda prompt: env_row(prompt, cfg, step=step),
            answer_key=cfg.data.answer_key,
            env_reward_weight=cfg.rollout.env_reward_weight,
            judge_engine=ctx.judge_engine,
            load=PendingLoad(),
        )
        with timed(stats.timings, "rollout+genrm"), ctx.plan.phase("rollout"):
            asyncio.run(
                stream.run(
                    ctx.sampler,  # polls should_abort (every rank full), never blocks
                    draw=ctx.draw,
                    keep=lambda judged: keep(judged, ctx, stats),
                    should_stop=ctx.should_stop,  # between judged groups: the tail cut
                )
            )
        ctx.sampler.record_aborted(stream.num_groups_cut, num_tokens=stream.num_cut_tokens)
        stream_stats = stream.stats()
        if ctx.plan.has_memory_split:  # the next split follows the step's live queues
            ctx.plan.update_load(**stream.pending_tokens())
        turn_stats = stream.turn_stats
    else:

        def judge_round(prompts: list[Prompt], num_round: int) -> list[Scored]:
            sampling = ctx.sampling(step, stats.num_rounds + num_round)
            # a row whose reset failed has fewer than n trajectories: its group is dropped
            judged, round_stats = genrm.judge_trajectories(
                ctx.multiturn,
                [env_row(prompt, cfg, step=step) for prompt in prompts],
                prompts,
                sampling,
                scorer=ctx.scorer,
                plan=ctx.plan,
                timings=stats.timings,
                answer_key=cfg.data.answer_key,
                env_reward_weight=cfg.rollout.env_reward_weight,
                should_stop=ctx.should_stop,
                should_overlap=ctx.should_overlap,  # judged as each ends (partial)
                judge_engine=ctx.judge_engine,
            )
            turn_stats.merge(round_stats)
            return judged

        stats.num_rounds += genrm.judge_in_rounds(
            ctx.sampler,
            draw=ctx.draw,
            judge_round=judge_round,
            keep=lambda judged: keep(judged, ctx, stats),
            should_stop=ctx.should_stop,
        )
    # summed over ranks, turns_mean from the summed turns (the mean summarize then takes of
    # these equal values is the sum)
    total = core.reduce_turn_metrics(
        turn_stats.as_metrics(prefix="multiturn/"),
        num_turns=sum(turn_stats.turns),
        group=ctx.runtime.dp_group,
    )
    # waits for every rank; core.StepStopped on every rank if a stop signal ended one
    batch, sampling_stats = take_batch(ctx.sampler, should_stop=ctx.should_stop())
    if stream_stats:
        stats.num_rounds = int(sampling_stats["num_rounds"])
    return batch, sampling_stats | total | stream_stats


def make_multiturn(cfg: TrainConfig, engine, tokenizer, resources: ClosingStack):
    """The run's MultiTurnRollout: tools in worker processes (a killable pool, closed at the
    end), the chat template of the policy's tokenizer. A vision-language policy: the policy's
    image processor and vision tokens, so a tool may return pictures whatever the engine (the
    built-in one has them itself; vLLM and SGLang do not hand theirs out)."""
    runner = rollout.env.PoolToolRunner.from_timeout(cfg.rollout.tool_timeout_s)
    resources.close_later(runner.pool)
    model_dir = policy_field(cfg.policy, "model_dir")
    vision = core.VisionModel.from_pretrained(model_dir)
    images: dict[str, Any] = {}
    if vision.image_token_id is not None and vision.has_image_processor:
        images = {
            "image_processor": core.load_image_processor(model_dir),
            "image_token_id": vision.image_token_id,
            "vision_token_ids": vision.stop_token_ids,
        }
    return rollout.MultiTurnRollout(
        engine,
        cfg.rollout.env_config(dict(cfg.data.chat_template_kwargs)),
        tokenizer=tokenizer,
        runner=runner,
        **images,
    )
