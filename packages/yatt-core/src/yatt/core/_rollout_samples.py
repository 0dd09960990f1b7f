"""Training samples from rollout completions: the one place a trainer turns what an engine
generated into what the policy trains on.

    samples = rollout_samples(completions, rewards, group_ids)   # one dict per completion
    batch = rollout_batch(samples)                                # padded; also of no samples

A completion is anything with `prompt_ids`, `response_ids` and `logprobs` (one per response
token), e.g. `yatt.rollout.Completion`: yatt-core does not depend on yatt-rollout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from yatt.core._batch import Batch

# Per-token fields of a rollout sample (the rest, group_id and reward, are per sample).
ROLLOUT_TOKEN_KEYS = ("input_ids", "loss_mask", "rollout_logprobs")


class CompletionLike(Protocol):
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]


def rollout_samples(
    completions: Iterable[CompletionLike],
    rewards: Iterable[float],
    group_ids: Iterable[int],
) -> list[dict[str, Any]]:
    """One training sample per completion: prompt + response tokens, the loss on the response
    only, the sampler's logprob per response token (0.0 on the prompt), its GRPO group and
    reward."""
    samples = []
    for completion, reward, group_id in zip(completions, rewards, group_ids, strict=True):
        prompt, response = list(completion.prompt_ids), list(completion.response_ids)
        if len(completion.logprobs) != len(response):
            raise ValueError(
                f"a completion has {len(completion.logprobs)} logprobs for {len(response)} "
                "response tokens; the engine must return one per sampled token"
            )
        samples.append(
            {
                "input_ids": prompt + response,
                "loss_mask": [0] * len(prompt) + [1] * len(response),
                "rollout_logprobs": [0.0] * len(prompt) + [float(x) for x in completion.logprobs],
                "group_id": int(group_id),
                "reward": float(reward),
            }
        )
    return samples


def rollout_batch(samples: Sequence[Mapping[str, Any]]) -> Batch:
    """A padded Batch of `rollout_samples`; of none too (a rank whose DAPO refill drew no
    rows still joins the collectives with the same fields)."""
    return Batch.from_samples(samples, token_keys=ROLLOUT_TOKEN_KEYS, like=_empty_rollout_batch())


def _empty_rollout_batch() -> Batch:
    placeholder = {
        "input_ids": [0],
        "loss_mask": [0],
        "rollout_logprobs": [0.0],
        "group_id": 0,
        "reward": 0.0,
    }
    return Batch.from_samples([placeholder], token_keys=ROLLOUT_TOKEN_KEYS).select([])
