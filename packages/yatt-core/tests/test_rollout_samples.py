from dataclasses import dataclass

import pytest
import torch

from yatt.core import ROLLOUT_TOKEN_KEYS, rollout_batch, rollout_samples


@dataclass
class FakeCompletion:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


def test_samples_put_the_loss_on_the_response_and_keep_groups_and_rewards():
    completions = [
        FakeCompletion([5, 6], [7, 8, 9], [-0.5, -1.0, -2.0]),
        FakeCompletion([5], [3], [-0.25]),
    ]
    samples = rollout_samples(completions, rewards=[1, -1.0], group_ids=[4, 4])
    assert samples[0] == {
        "input_ids": [5, 6, 7, 8, 9],
        "loss_mask": [0, 0, 1, 1, 1],
        "rollout_logprobs": [0.0, 0.0, -0.5, -1.0, -2.0],
        "group_id": 4,
        "reward": 1.0,
        "is_truncated": False,  # a completion without finish_reason counts as finished
        "policy_version": [0] * 5,  # no versions given: every token the current one (0)
    }
    batch = rollout_batch(samples)
    assert batch.lengths.tolist() == [5, 2]
    assert batch.tokens["loss_mask"].sum(dim=1).tolist() == [3, 1]
    assert torch.equal(batch.samples["reward"], torch.tensor([1.0, -1.0]))
    assert batch.tokens["rollout_logprobs"][1, :2].tolist() == [0.0, -0.25]


@dataclass
class EngineCompletion(FakeCompletion):
    finish_reason: str


@pytest.mark.parametrize(
    ("finish_reason", "cut_at", "is_truncated"),
    [
        pytest.param("length", (), True, id="length"),
        pytest.param("stop", (), False, id="stop"),
        pytest.param("abort", (), False, id="abort"),
        pytest.param("length", (8,), False, id="cut-before-a-token-is-not-truncated"),
    ],
)
def test_samples_carry_whether_the_engine_truncated_them(finish_reason, cut_at, is_truncated):
    completion = EngineCompletion([5], [7, 8, 9], [-0.5, -1.0, -2.0], finish_reason)
    samples = rollout_samples([completion], [1.0], [0], cut_at_token_ids=cut_at)
    assert samples[0]["is_truncated"] is is_truncated
    batch = rollout_batch(samples)
    assert batch.samples["is_truncated"].dtype == torch.bool
    assert batch.samples["is_truncated"].tolist() == [is_truncated]


def test_an_empty_batch_has_the_same_fields_and_dtypes():
    full = rollout_batch(rollout_samples([FakeCompletion([1], [2], [-1.0])], [0.5], [0]))
    empty = rollout_batch([])
    assert len(empty.lengths) == 0
    assert set(empty.tokens) == set(full.tokens) and set(empty.samples) == set(full.samples)
    for key in ROLLOUT_TOKEN_KEYS:
        assert empty.tokens[key].dtype == full.tokens[key].dtype
    assert empty.samples["group_id"].dtype == full.samples["group_id"].dtype


def test_mismatched_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="2 logprobs for 1 response tokens"):
        rollout_samples([FakeCompletion([1], [2], [-1.0, -2.0])], [0.0], [0])
    with pytest.raises(ValueError):  # one reward short
        rollout_samples([FakeCompletion([1], [2], [-1.0])], [], [0])


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        pytest.param([7, 8, 99], [7, 8], id="stopped-at-the-token"),
        pytest.param([7, 98, 8, 99], [7], id="first-of-several"),
        pytest.param([99, 7], [], id="nothing-left"),
        pytest.param([7, 8], [7, 8], id="none-kept-whole"),
    ],
)
def test_a_response_is_cut_before_the_first_cut_token_with_its_logprobs(response, expected):
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    completion = FakeCompletion([5, 6], response, logprobs)
    (sample,) = rollout_samples([completion], [1.0], [0], cut_at_token_ids={98, 99})
    assert sample["input_ids"] == [5, 6, *expected]
    assert sample["loss_mask"] == [0, 0] + [1] * len(expected)
    assert sample["rollout_logprobs"] == [0.0, 0.0, *logprobs[: len(expected)]]
    # The same tokens without the option stay in the response.
    (whole,) = rollout_samples([completion], [1.0], [0])
    assert whole["input_ids"] == [5, 6, *response]


@dataclass
class HandTrajectory(FakeCompletion):
    """A two-turn trajectory built by hand: turn 1 sampled [7, 8], the tool result and the
    template between turns [50, 51, 52] (not sampled), turn 2 sampled [9]."""

    loss_mask: list[int]
    finish_reason: str = "stop"


def test_a_trajectory_keeps_its_loss_mask_so_no_loss_falls_on_tool_tokens():
    trajectory = HandTrajectory(
        [1, 2], [7, 8, 50, 51, 52, 9], [-0.5, -1.0, 0.0, 0.0, 0.0, -2.0], [1, 1, 0, 0, 0, 1]
    )
    (sample,) = rollout_samples([trajectory], rewards=[1.0], group_ids=[0])
    assert sample["input_ids"] == [1, 2, 7, 8, 50, 51, 52, 9]
    assert sample["loss_mask"] == [0, 0, 1, 1, 0, 0, 0, 1]
    assert sample["rollout_logprobs"] == [0.0, 0.0, -0.5, -1.0, 0.0, 0.0, 0.0, -2.0]
    # Cut at a sampled token: the mask is cut with the response.
    (cut,) = rollout_samples([trajectory], rewards=[1.0], group_ids=[0], cut_at_token_ids={8, 51})
    assert cut["input_ids"] == [1, 2, 7]
    assert cut["loss_mask"] == [0, 0, 1]
    batch = rollout_batch([sample, cut])
    assert batch.tokens["loss_mask"].sum(dim=1).tolist() == [3, 1]
    # Never at a tool's or the template's token (mask 0): an image token there comes with its
    # image (a tool's picture), not sampled by the policy.
    (whole,) = rollout_samples([trajectory], rewards=[1.0], group_ids=[0], cut_at_token_ids={51})
    assert whole == sample


def test_a_loss_mask_of_the_wrong_length_is_a_clear_error():
    bad = HandTrajectory([1], [7, 8], [-0.5, -1.0], [1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        rollout_samples([bad], rewards=[0.0], group_ids=[0])
