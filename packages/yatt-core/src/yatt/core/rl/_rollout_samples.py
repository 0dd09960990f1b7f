"""Training samples from rollout completions: the one place a trainer turns what an engine
generated into what the policy trains on.

    samples = rollout_samples(completions, rewards, group_ids)   # one dict per completion
    batch = rollout_batch(samples)                                # padded; also of no samples

With a vision-language policy, `vision_inputs` gives each completion its prompt's images
(yatt.core.VisionInputs, None for a prompt without images; the n completions of a prompt share
one object, not copies): every sample then carries them under VISION_INPUTS_KEY, a per-sample
metadata field of the Batch, which Batch.rebalance moves with the sample.

`cut_at_token_ids` ends a response before the first of these tokens, dropping it, what follows
and their logprobs: e.g. a vision-language policy's vision special tokens (<|image_pad|>), which
a sampler may emit but a response must never carry into training (the policy would read them as
image tokens without an image). Stop generation at them too (SamplingParams.stop_token_ids) and
count the cut responses.

Every sample carries "is_truncated" (bool): the engine stopped the response at its token
budget (finish_reason "length"), so it has no end; DAPO filters or punishes such responses
(yatt.core.rl._overlong). A response cut before one of `cut_at_token_ids` is not truncated.

Every token carries "policy_version" (int): the version of the policy weights that sampled it
(off-policy steps, yatt.core.rl._staleness). A completion sampled under one version gives one
int; a response resumed across versions (a partial rollout finished a step later, a multi-turn
trajectory whose turns ran under different weights) gives one version per response token.
Prompt positions carry the version of the first response token (the one that started the
sample; they are off the loss mask, so no metric reads them). Without `policy_versions` every
token carries `policy_version` (the current version: an on-policy step).

A completion is anything with `prompt_ids`, `response_ids`, `logprobs` (one per response
token) and `finish_reason`, e.g. `yatt.rollout.Completion`: yatt-core does not depend on
yatt-rollout. A completion without `finish_reason` (a hand-made one) counts as finished.
A completion with a `loss_mask` (one 0/1 per response token, e.g. a multi-turn
`yatt.rollout.env.Trajectory`) keeps it: tool results and the template's tokens between turns
sit in the response with mask 0, so no loss falls on them; it is cut like the response. Such a
response is cut only at a sampled token (mask 1) of `cut_at_token_ids`: an image token in a
tool's result (mask 0) comes with its image (Trajectory.image_inputs), never a cut point.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any, Protocol

from yatt.core.data._batch import Batch
from yatt.core.rl._overlong import IS_TRUNCATED_KEY
from yatt.core.vision._vision_inputs import VISION_INPUTS_KEY, VisionInputs

# Per-token fields of a rollout sample (the rest, group_id and reward, are per sample).
ROLLOUT_TOKEN_KEYS = ("input_ids", "loss_mask", "rollout_logprobs", "policy_version")
# The per-token policy version (an int64 [B, T] field of the batch; see the module docstring).
POLICY_VERSION_KEY = "policy_version"
# The engine's finish_reason for a response cut at max_new_tokens (yatt.rollout.FinishReason).
_LENGTH_FINISH = "length"


class CompletionLike(Protocol):
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str | None  # "stop", "length" or "abort" (yatt.rollout.FinishReason)


def rollout_samples(
    completions: Iterable[CompletionLike],
    rewards: Iterable[float],
    group_ids: Iterable[int],
    *,
    vision_inputs: Iterable[VisionInputs | None] | None = None,
    cut_at_token_ids: Collection[int] = (),
    policy_version: int = 0,
    policy_versions: Iterable[int | Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """One training sample per completion: prompt + response tokens, the loss on the response
    only, the sampler's logprob per response token (0.0 on the prompt), its GRPO group and
    reward, whether the engine truncated it (is_truncated); and its prompt's images when
    `vision_inputs` is given (one entry per completion).
    A response is cut before the first of `cut_at_token_ids` (its logprobs with it).

    policy_versions: per completion, the policy version that sampled it (an int) or one version
    per response token (a sequence, for a response that spans versions); None stamps every
    token with `policy_version`, the trainer's current version."""
    completions = list(completions)
    _check_version("policy_version", policy_version)
    versions: list[int | Sequence[int]] | None = None
    if policy_versions is not None:
        versions = list(policy_versions)
        if len(versions) != len(completions):
            raise ValueError(
                f"policy_versions has {len(versions)} entries for {len(completions)} "
                "completions; give one per completion (an int, or one per response token)"
            )
    images: list[VisionInputs | None] | None = None
    if vision_inputs is not None:
        images = list(vision_inputs)
        if len(images) != len(completions):
            raise ValueError(
                f"vision_inputs has {len(images)} entries for {len(completions)} completions; "
                "give one per completion (None for a prompt without images)"
            )
        for i, vision in enumerate(images):
            if vision is not None and not isinstance(vision, VisionInputs):
                raise ValueError(
                    f"vision_inputs[{i}] is a {type(vision).__name__}; pass a "
                    "yatt.core.VisionInputs (yatt.core.encode_vision_prompt makes one) or None"
                )
    samples = []
    for i, (completion, reward, group_id) in enumerate(
        zip(completions, rewards, group_ids, strict=True)
    ):
        prompt, response = list(completion.prompt_ids), list(completion.response_ids)
        if len(completion.logprobs) != len(response):
            raise ValueError(
                f"a completion has {len(completion.logprobs)} logprobs for {len(response)} "
                "response tokens; the engine must return one per sampled token"
            )
        logprobs = [float(x) for x in completion.logprobs]
        token_versions = _response_versions(
            policy_version if versions is None else versions[i], len(response), i
        )
        mask = _response_mask(completion, len(response))
        # Only sampled tokens (mask 1) are the policy's to cut at: a multi-turn trajectory's
        # tool results (mask 0) may hold image tokens that came with their images.
        cut = _first_index_of(response, cut_at_token_ids, where=mask)
        if cut is not None:
            response, logprobs = response[:cut], logprobs[:cut]
            token_versions, mask = token_versions[:cut], mask[:cut]
        first_version = (
            token_versions[0]
            if token_versions
            else _first_version(policy_version if versions is None else versions[i], policy_version)
        )
        finish_reason = getattr(completion, "finish_reason", None)
        samples.append(
            {
                "input_ids": prompt + response,
                "loss_mask": [0] * len(prompt) + mask,
                "rollout_logprobs": [0.0] * len(prompt) + logprobs,
                "group_id": int(group_id),
                "reward": float(reward),
                IS_TRUNCATED_KEY: finish_reason == _LENGTH_FINISH and cut is None,
                POLICY_VERSION_KEY: [first_version] * len(prompt) + token_versions,
            }
        )
        if images is not None:
            samples[-1][VISION_INPUTS_KEY] = images[i]
    return samples


def _response_mask(completion: Any, num_tokens: int) -> list[int]:
    """The response's loss mask: the completion's own `loss_mask` when it has one (a
    multi-turn trajectory masks the tool results and template tokens between turns), else 1
    on every sampled token."""
    mask = getattr(completion, "loss_mask", None)
    if mask is None:
        return [1] * num_tokens
    mask = [int(m) for m in mask]
    if len(mask) != num_tokens or any(m not in (0, 1) for m in mask):
        raise ValueError(
            f"a completion's loss_mask has {len(mask)} entries for {num_tokens} response tokens "
            "(or values other than 0/1); give one 0/1 per response token (1: sampled, trained)"
        )
    return mask


def _check_version(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: a policy version is an int >= 0 (the trainer's step)")


def _response_versions(versions: int | Sequence[int], num_tokens: int, index: int) -> list[int]:
    """One version per response token from an int or a per-token sequence."""
    if isinstance(versions, int) and not isinstance(versions, bool):
        _check_version(f"policy_versions[{index}]", versions)
        return [versions] * num_tokens
    versions = list(versions)
    if len(versions) != num_tokens:
        raise ValueError(
            f"policy_versions[{index}] has {len(versions)} versions for {num_tokens} response "
            "tokens; give one int for the whole response or one per response token"
        )
    for version in versions:
        _check_version(f"policy_versions[{index}]", version)
    # A token cannot be older than the one before it: weights only move forward.
    if any(b < a for a, b in pairwise(versions)):
        raise ValueError(
            f"policy_versions[{index}]={versions}: versions must not decrease along a response "
            "(each token is sampled under weights at least as new as the previous token's)"
        )
    return [int(v) for v in versions]


def _first_version(versions: int | Sequence[int], default: int) -> int:
    """The version that started a response with no tokens left."""
    if isinstance(versions, int):
        return versions
    return default


def _first_index_of(
    token_ids: Sequence[int], wanted: Collection[int], *, where: Sequence[int] | None = None
) -> int | None:
    """The first position holding a `wanted` token (among those where `where` is true)."""
    if not wanted:
        return None
    wanted = set(wanted)
    return next(
        (i for i, token in enumerate(token_ids) if token in wanted and (where is None or where[i])),
        None,
    )


def rollout_batch(samples: Sequence[Mapping[str, Any]], *, policy_version: int = 0) -> Batch:
    """A padded Batch of `rollout_samples`; of none too (a rank whose DAPO refill drew no
    rows still joins the collectives with the same fields). A sample built by hand without
    "policy_version" gets `policy_version` on every token."""
    _check_version("policy_version", policy_version)
    samples = [
        sample
        if POLICY_VERSION_KEY in sample
        else {**sample, POLICY_VERSION_KEY: [policy_version] * len(sample["input_ids"])}
        for sample in samples
    ]
    return Batch.from_samples(samples, token_keys=ROLLOUT_TOKEN_KEYS, like=_empty_rollout_batch())


def _empty_rollout_batch() -> Batch:
    placeholder = {
        "input_ids": [0],
        "loss_mask": [0],
        "rollout_logprobs": [0.0],
        "group_id": 0,
        "reward": 0.0,
        IS_TRUNCATED_KEY: False,
        POLICY_VERSION_KEY: [0],
    }
    return Batch.from_samples([placeholder], token_keys=ROLLOUT_TOKEN_KEYS).select([])
