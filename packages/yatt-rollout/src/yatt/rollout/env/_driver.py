"""The multi-turn rollout driver: many trajectories at once over any RolloutEngine.

    row --reset--> messages --template--> prompt ids --engine.stream--> sampled ids (mask 1)
                      ^                                                     | parse tool calls
                      |                                                     v
                      '-- tool messages <--session.call (worker, timeout)-- calls
                             --template diff--> appended ids (mask 0)

Each trajectory is its own task: its next turn enters the engine as soon as its tools have
answered, never at a round barrier. The built-in engine joins each turn's call to its running
loop (continuous batching across trajectories); vLLM and SGLang reuse the conversation's KV
through their prefix caches, since each turn sends the full ids so far.

Images (a vision-language policy, env/_images.py): a tool that returns a PIL image (or image
content parts) gives a tool message with image parts; its placeholders are expanded to the
image's tokens, the image joins the trajectory (Trajectory.images, Trajectory.image_inputs),
and each later turn's Request carries every image so far, so the engine prefills their
features (the built-in engine continues its kept KV with them, builtin/_batcher.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from yatt.rollout._keys import derive_key
from yatt.rollout._types import Completion, Request, RolloutEngine, SamplingParams
from yatt.rollout.env._config import EnvConfig
from yatt.rollout.env._images import (
    ImageInputs,
    ImageResultError,
    ToolImages,
    concat_image_inputs,
    image_parts,
    message_images,
)
from yatt.rollout.env._parsers import ToolCall, load_tool_parser
from yatt.rollout.env._runner import (
    ThreadToolRunner,
    ToolFailure,
    ToolRunner,
    format_image_output,
    format_output,
)
from yatt.rollout.env._tokens import ChatTokens, TemplateMismatchError
from yatt.rollout.env._tools import EnvKind, build_env_kinds
from yatt.rollout.env._trajectory import MultiTurnStats, Trajectory

logger = logging.getLogger(__name__)

# A vision-language model config's special vision tokens (yatt.core's VISION_SPECIAL_TOKEN_FIELDS).
_VISION_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


class MultiTurnRollout:
    """Samples trajectories of `config`'s environments or tools with `engine`.

    environments / tools: classes and functions to use instead of config.environment /
    config.tools (the specs); everything is checked here, before any generation.
    runner: where environments and tools run (default: threads of this process).
    image_processor, image_token_id: a vision-language policy's (default: the engine's, when it
    has them: the built-in engine serving a Qwen2-VL-family model); with them a tool may return
    images (env/_images.py). Without them an image result is an error observation.
    vision_token_ids: the policy's vision special tokens (yatt.core's VisionModel.stop_token_ids;
    default: the image token and, when the engine's model config names them, its video and
    vision start/end tokens). A turn that samples one ends the trajectory before it (cause
    "image_token"): no image follows it, and the template's turn end would be miscounted.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        config: EnvConfig,
        *,
        environments: Sequence[type] | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        tokenizer: Any = None,
        runner: ToolRunner | None = None,
        image_processor: Any = None,
        image_token_id: int | None = None,
        vision_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        max_seq_len = getattr(getattr(engine, "config", None), "max_seq_len", None)
        if isinstance(max_seq_len, int) and config.max_trajectory_tokens >= max_seq_len:
            raise ValueError(
                f"EnvConfig.max_trajectory_tokens={config.max_trajectory_tokens} does not fit "
                f"the engine's context (max_seq_len={max_seq_len}, which must leave room for "
                "one new token); lower it or raise the engine's max_seq_len"
            )
        ttl_s = getattr(engine, "kept_kv_ttl_s", None)
        if isinstance(ttl_s, (int, float)) and ttl_s < config.tool_timeout_s:
            logger.warning(
                "engine.kept_kv_ttl_s=%g < EnvConfig.tool_timeout_s=%g: a conversation whose "
                "tool runs longer than %g s is prefilled again on its next turn (raise the "
                "engine's kept_kv_ttl_s to keep it)",
                ttl_s,
                config.tool_timeout_s,
                ttl_s,
            )
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.kinds: dict[str, EnvKind] = build_env_kinds(
            config.environment if environments is None else environments,
            config.tools if tools is None else tools,
        )
        self.parser = load_tool_parser(config.tool_parser)
        self.runner = runner if runner is not None else ThreadToolRunner()
        check_kind = getattr(self.runner, "check_kind", None)
        if check_kind is not None:
            for kind in self.kinds.values():
                check_kind(kind)
        if image_processor is None:
            image_processor = getattr(engine, "image_processor", None)
        if image_token_id is None:
            image_token_id = getattr(engine, "image_token_id", None)
        if image_processor is not None and image_token_id is None:
            raise ValueError(
                "MultiTurnRollout: an image_processor without the image_token_id its prompts "
                "repeat (e.g. tokenizer.convert_tokens_to_ids('<|image_pad|>'))"
            )
        self.images = (
            ToolImages(image_processor, image_token_id) if image_processor is not None else None
        )
        token_id = None if self.images is None else self.images.image_token_id
        if vision_token_ids is None:
            model_config = getattr(getattr(engine, "model", None), "config", None)
            vision_token_ids = [
                value
                for value in (getattr(model_config, name, None) for name in _VISION_TOKEN_FIELDS)
                if isinstance(value, int) and not isinstance(value, bool)
            ]
        # Tokens a turn must not sample (none for a text-only policy).
        self._vision_tokens = (
            frozenset() if token_id is None else frozenset({token_id, *vision_token_ids})
        )
        self._tokens = {
            name: ChatTokens(
                self.tokenizer, kind.schemas, config.chat_template_kwargs, image_token_id=token_id
            )
            for name, kind in self.kinds.items()
        }

    async def run(
        self, rows: Sequence[dict[str, Any]], sampling: SamplingParams
    ) -> tuple[list[Trajectory], MultiTurnStats]:
        """Every trajectory (sampling.n per row), ordered by (row, sample), and the counts."""
        stats = MultiTurnStats()
        trajectories = [t async for t in self.stream(rows, sampling, stats=stats)]
        trajectories.sort(key=lambda t: (t.row_index, t.sample_index))
        return trajectories, stats

    async def stream(
        self,
        rows: Sequence[dict[str, Any]],
        sampling: SamplingParams,
        *,
        stats: MultiTurnStats | None = None,
        first_row_index: int = 0,
    ) -> AsyncIterator[Trajectory]:
        """Each trajectory as soon as it ends (any order); skipped rows are counted in `stats`.

        rows[i]'s trajectories get row_index first_row_index + i: a caller that streams
        several calls at once (genrm.TrajectoryStream) keeps its rows apart, and each row's
        turns draw from their own seed key (derived from the row index) under one seed.
        Closing the stream early cancels the trajectories still running.
        """
        stats = stats if stats is not None else MultiTurnStats()
        # Each trajectory's turns share a session id, so an engine that keeps a conversation's
        # KV between turns (the built-in one) continues it instead of prefilling it again.
        prefix = secrets.token_hex(6)
        tasks = [
            asyncio.create_task(self._run_one(i, j, row, sampling, stats, f"{prefix}-{i}-{j}"))
            for i, row in enumerate(rows, start=first_row_index)
            for j in range(sampling.n)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                trajectory = await next_done
                if trajectory is not None:
                    yield trajectory
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _route(self, row: dict[str, Any]) -> EnvKind | None:
        if len(self.kinds) == 1:
            return next(iter(self.kinds.values()))
        return self.kinds.get(str(row.get(self.config.route_key, "")))

    async def _run_one(
        self,
        row_index: int,
        sample_index: int,
        row: dict[str, Any],
        sampling: SamplingParams,
        stats: MultiTurnStats,
        session_id: str,
    ) -> Trajectory | None:
        config = self.config
        kind = self._route(row)
        if kind is None:
            stats.num_unrouted += 1
            logger.warning(
                "row %d skipped: its %r=%r names no environment (have %s)",
                row_index,
                config.route_key,
                row.get(config.route_key),
                sorted(self.kinds),
            )
            return None
        session = self.runner.open(kind)
        try:
            try:
                first = await session.reset(dict(row), timeout_s=config.tool_timeout_s)
            except Exception as e:  # user code: a counted skip
                stats.num_reset_errors += 1
                logger.warning(
                    "row %d skipped: reset raised %s: %s", row_index, type(e).__name__, e
                )
                return None
            messages = _first_messages(row, first)
            if messages is None:
                stats.num_bad_rows += 1
                logger.warning(
                    "row %d skipped: it has no 'messages' or 'prompt' and reset gave no first "
                    "message",
                    row_index,
                )
                return None
            tokens = self._tokens[kind.name]
            try:
                pictures = message_images(messages)
                inputs = self._encode_images(pictures)
                counts = [] if inputs is None else self.images.tokens_per_image(inputs)
                prompt_ids = tokens.prompt_ids(messages, image_tokens=counts)
            except (ImageResultError, TemplateMismatchError) as e:
                stats.num_bad_rows += 1
                logger.warning("row %d skipped: its first messages' images: %s", row_index, e)
                return None
            trajectory = Trajectory(
                row_index=row_index,
                sample_index=sample_index,
                env_name=kind.name,
                prompt_ids=prompt_ids,
                response_ids=[],
                loss_mask=[],
                logprobs=[],
                messages=messages,
                tool_calls=[],
                num_turns=0,
                end_cause="stop",
                row=row,
                session_id=session_id,
                images=pictures,
                image_inputs=inputs,
            )
            trajectory.end_cause = await self._turns(trajectory, session, tokens, sampling, stats)
            if kind.has_reward:
                try:
                    reward = await session.get_reward(timeout_s=config.tool_timeout_s)
                    trajectory.env_reward = None if reward is None else float(reward)
                except Exception as e:  # user code: counted, reward left None
                    stats.num_reward_errors += 1
                    logger.warning("get_reward raised %s: %s", type(e).__name__, e)
            stats.num_trajectories += 1
            stats.turns.append(trajectory.num_turns)
            stats.end_causes[trajectory.end_cause] += 1
            return trajectory
        finally:
            session.close()
            release = getattr(self.engine, "release_sessions", None)
            if callable(release):
                release([session_id])

    async def _turns(
        self,
        trajectory: Trajectory,
        session: Any,
        tokens: ChatTokens,
        sampling: SamplingParams,
        stats: MultiTurnStats,
    ) -> str:
        """Generate, call tools, append; returns the end cause."""
        config = self.config
        messages = trajectory.messages
        for turn in range(config.max_turns):
            used = len(trajectory.prompt_ids) + len(trajectory.response_ids)
            budget = config.max_trajectory_tokens - used
            if budget < 1:
                return "max_trajectory_tokens"
            max_new = min(sampling.max_new_tokens, budget)
            completion = await self._generate(trajectory, turn, max_new, sampling)
            sampled, turn_logprobs = completion.response_ids, list(completion.logprobs)
            cut = next((i for i, t in enumerate(sampled) if t in self._vision_tokens), None)
            if cut is not None:
                # A vision token without an image: no engine or policy can read on (and the
                # turn does not end with the template's end token). The turn is kept up to it,
                # as rollout_samples cuts a response before one.
                trajectory.response_ids += sampled[:cut]
                trajectory.loss_mask += [1] * cut
                trajectory.logprobs += turn_logprobs[:cut]
                trajectory.num_turns += 1
                return "image_token"
            trajectory.response_ids += sampled
            trajectory.loss_mask += [1] * len(sampled)
            trajectory.logprobs += turn_logprobs
            trajectory.num_turns += 1
            if completion.finish_reason == "abort":
                return "abort"
            is_stop = completion.finish_reason == "stop" and bool(sampled)
            text = self.tokenizer.decode(
                sampled[:-1] if is_stop else sampled, skip_special_tokens=False
            )
            parsed = self.parser.parse(text)
            trajectory.tool_calls.append(parsed.calls)
            assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            good_calls = [c.as_message_call() for c in parsed.calls if c.error is None]
            if good_calls:
                assistant["tool_calls"] = good_calls
            messages.append(assistant)
            if not is_stop:
                return "max_trajectory_tokens" if max_new < sampling.max_new_tokens else "length"
            if not parsed.calls:
                return "stop"
            results = [await self._call(session, call, stats) for call in parsed.calls]
            observations = [message for message, _ in results]
            new_inputs = None
            for _, inputs in results:
                new_inputs = concat_image_inputs(new_inputs, inputs)
            # The tool results join the conversation (a judge reads them) even when the
            # trajectory ends here; their tokens are appended only when another turn follows.
            before = list(messages)
            messages += observations
            if session.is_done():
                return "env_ended"
            if turn + 1 == config.max_turns:
                return "max_turns"
            try:
                counts = [] if new_inputs is None else self.images.tokens_per_image(new_inputs)
                appended = tokens.appended_ids(
                    before, observations, end_token_id=sampled[-1], image_tokens=counts
                )
            except TemplateMismatchError as e:
                logger.warning("trajectory ended: %s", e)
                return "template_mismatch"
            stats.num_template_rewrites += not appended.is_prefix_exact
            # The next turn needs room for one new token.
            if used + len(sampled) + len(appended.ids) >= config.max_trajectory_tokens:
                return "max_trajectory_tokens"
            trajectory.response_ids += appended.ids
            trajectory.loss_mask += [0] * len(appended.ids)
            trajectory.logprobs += [0.0] * len(appended.ids)
            if new_inputs is not None:
                trajectory.images += message_images(observations)
                trajectory.image_inputs = concat_image_inputs(trajectory.image_inputs, new_inputs)
        return "max_turns"  # not reached: the loop returns at its last turn

    async def _generate(
        self, trajectory: Trajectory, turn: int, max_new: int, sampling: SamplingParams
    ) -> Completion:
        seed = sampling.seed
        if seed is not None:  # each (row, sample, turn) draws from its own key
            sample_key = derive_key(seed, trajectory.row_index, trajectory.sample_index)
            seed = derive_key(sample_key, turn, 0)
        request = Request(
            prompt_ids=trajectory.prompt_ids + trajectory.response_ids,
            # Every image so far: raw (engines that run their own processor) and processed
            # (the built-in engine takes these instead).
            images=list(trajectory.images) or None,
            image_inputs=trajectory.image_inputs,
            request_id=f"{trajectory.row_index}/{trajectory.sample_index}/{turn}",
            max_new_tokens=max_new,
            session_id=trajectory.session_id,
        )
        turn_sampling = dataclasses.replace(sampling, n=1, seed=seed)
        result = None
        stream = self.engine.stream([request], turn_sampling)
        try:
            async for completion in stream:
                result = completion
        finally:
            # Closed here, not when collected: a cancelled trajectory (the caller closed the
            # rollout's stream) ends its engine call now.
            await stream.aclose()
        assert result is not None, "the engine's stream ended without the completion"
        return result

    async def _call(
        self, session: Any, call: ToolCall, stats: MultiTurnStats
    ) -> tuple[dict[str, Any], ImageInputs | None]:
        """The call's tool message, and its images processed (None: a text result)."""
        config = self.config
        stats.num_tool_calls += 1
        if call.error is not None:
            outcome: Any = ToolFailure("malformed", f"Error: {call.error}")
        else:
            outcome = await session.call(call.name, call.arguments, timeout_s=config.tool_timeout_s)
        inputs = None
        if not isinstance(outcome, ToolFailure):
            try:
                parts = image_parts(outcome)
                if parts is not None:
                    outcome, inputs = format_image_output(
                        parts,
                        max_bytes=config.max_tool_output_bytes,
                        max_tokens=config.max_tool_output_tokens,
                        tokenizer=self.tokenizer,
                        images=self.images,
                    )
            except ImageResultError as e:
                outcome = ToolFailure(e.cause, f"Error: {call.name} returned an image: {e}")
        content: Any
        if isinstance(outcome, ToolFailure):
            stats.tool_errors[outcome.cause] += 1
            content = outcome.message
        elif inputs is not None:
            content = outcome  # the image content parts
        else:
            content = format_output(
                outcome,
                max_bytes=config.max_tool_output_bytes,
                max_tokens=config.max_tool_output_tokens,
                tokenizer=self.tokenizer,
            )
        message = {"role": "tool", "content": content}
        if call.name:
            message["name"] = call.name
        return message, inputs

    def _encode_images(self, pictures: list[Any]) -> ImageInputs | None:
        """The first messages' images processed (None without any); ImageResultError when the
        policy takes none."""
        if not pictures:
            return None
        if self.images is None:
            raise ImageResultError(
                "they hold images, but the policy takes no images", cause="image_unsupported"
            )
        return self.images.encode(pictures)


def _first_messages(row: dict[str, Any], first: Any) -> list[dict[str, Any]] | None:
    """The conversation a trajectory starts from: the row's `messages` (or `prompt` as one user
    message); a string from reset replaces the last user message."""
    if isinstance(row.get("messages"), list):
        messages = [dict(m) for m in row["messages"]]
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        messages = []
    if first is not None:
        while messages and messages[-1].get("role") == "user":
            messages.pop()
        messages.append({"role": "user", "content": str(first)})
    return messages or None
