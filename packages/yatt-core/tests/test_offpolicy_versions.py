"""Per-token policy versions in the rollout batch (issue 48): every token records the version
of the weights that sampled it, kept through mini-batch splits, selects and concatenation."""

NUM_GPUS = 0

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from yatt.core import Batch, rollout_batch, rollout_samples, split_mini_batches
from yatt.testing import run_ranks

RANKS_WORKER = Path(__file__).with_name("_offpolicy_ranks_worker.py")


@dataclass
class FakeCompletion:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


def _completion(num_prompt, num_response):
    return FakeCompletion(
        list(range(1, num_prompt + 1)),
        list(range(10, 10 + num_response)),
        [-0.1] * num_response,
    )


def test_no_versions_stamp_every_token_with_the_current_version():
    (sample,) = rollout_samples([_completion(2, 3)], [1.0], [0], policy_version=7)
    assert sample["policy_version"] == [7, 7, 7, 7, 7]


def test_a_completion_version_or_per_token_versions_are_kept():
    completions = [_completion(2, 3), _completion(1, 4)]
    samples = rollout_samples(
        completions, [1.0, 0.0], [0, 0], policy_version=9, policy_versions=[5, [3, 3, 4, 5]]
    )
    assert samples[0]["policy_version"] == [5, 5, 5, 5, 5]
    # The prompt carries the version that started the response (the first response token's).
    assert samples[1]["policy_version"] == [3, 3, 3, 4, 5]
    batch = rollout_batch(samples)
    assert batch.tokens["policy_version"].dtype == torch.int64
    assert batch.tokens["policy_version"].tolist() == [[5, 5, 5, 5, 5], [3, 3, 3, 4, 5]]


def test_a_cut_response_drops_the_versions_of_the_cut_tokens():
    completion = FakeCompletion([1], [7, 8, 99, 6], [-0.1] * 4)
    (sample,) = rollout_samples(
        [completion], [1.0], [0], cut_at_token_ids={99}, policy_versions=[[1, 2, 3, 4]]
    )
    assert sample["input_ids"] == [1, 7, 8]
    assert sample["policy_version"] == [1, 1, 2]


@pytest.mark.parametrize(
    ("versions", "match"),
    [
        pytest.param([[1, 2]], "2 versions for 3 response tokens", id="short"),
        pytest.param([[2, 1, 3]], "must not decrease", id="decreasing"),
        pytest.param([-1], "int >= 0", id="negative"),
        pytest.param([1, 2], "2 entries for 1 completions", id="one-per-completion"),
    ],
)
def test_bad_versions_are_clear_errors(versions, match):
    with pytest.raises(ValueError, match=match):
        rollout_samples([_completion(1, 3)], [1.0], [0], policy_versions=versions)


def test_hand_built_rows_get_the_given_version_and_an_empty_batch_the_field():
    rows = [
        {
            "input_ids": [1, 2],
            "loss_mask": [0, 1],
            "rollout_logprobs": [0.0, -0.5],
            "group_id": 0,
            "reward": 1.0,
            "is_truncated": False,
        }
    ]
    batch = rollout_batch(rows, policy_version=4)
    assert batch.tokens["policy_version"].tolist() == [[4, 4]]
    empty = rollout_batch([])
    assert empty.tokens["policy_version"].dtype == torch.int64
    assert len(Batch.concat([empty, batch])) == 1


def test_versions_follow_their_samples_through_mini_batches_and_concat():
    # Each sample's versions are a function of its group: after any split every row must
    # still carry its own group's versions.
    completions, rewards, groups, versions = [], [], [], []
    for group in range(4):
        for member in range(2):
            num_response = 2 + group + member
            completions.append(_completion(1 + member, num_response))
            rewards.append(float(member))
            groups.append(group)
            versions.append([group] * (num_response - 1) + [group + 1])
    batch = rollout_batch(rollout_samples(completions, rewards, groups, policy_versions=versions))
    parts = split_mini_batches(batch, 2, seed=3)
    seen = 0
    for part in [*parts, Batch.concat(parts)]:
        for row in part.to_samples():
            group = int(row["group_id"])
            response = row["policy_version"][row["loss_mask"] > 0].tolist()
            assert response == [group] * (len(response) - 1) + [group + 1]
            seen += 1
    assert seen == 2 * len(batch)


def test_versions_follow_their_samples_through_a_rebalance_on_two_gloo_ranks():
    # Real processes: Batch.rebalance moves rows point-to-point; restore brings them home.
    run_ranks([sys.executable, str(RANKS_WORKER)], 2, env={"CUDA_VISIBLE_DEVICES": ""})
