"""Overlong responses: DAPO's soft punishment (arXiv:2503.14476 eq. 13) at the buffer's
edges, the overlong filter's masks, the truncation metric, and the config's checks."""

import pytest
import torch

from yatt.core import (
    Batch,
    OverlongConfig,
    PolicyLoss,
    compute_overlong_penalty,
    compute_truncation_metrics,
    mask_truncated_responses,
)

NUM_GPUS = 0


def _eq13(length: int, l_max: int, l_cache: int) -> float:
    # DAPO eq. 13, written out.
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("length", [0, 11, 12, 13, 14, 15, 16, 17, 40])
def test_soft_punishment_at_the_buffers_edges(length):
    # L_max = 16, L_cache = 4: free up to 12, then -1/4 per token to -1 at 16, -1 beyond.
    penalty = compute_overlong_penalty(
        torch.tensor([length]), max_response_tokens=16, buffer_tokens=4
    )
    assert penalty.item() == pytest.approx(_eq13(length, 16, 4))
    scaled = compute_overlong_penalty(
        torch.tensor([length]), max_response_tokens=16, buffer_tokens=4, penalty_factor=0.5
    )
    assert scaled.item() == pytest.approx(0.5 * _eq13(length, 16, 4))


def _batch(response_lengths=(3, 6, 6, 1), truncated=(False, True, True, False)) -> Batch:
    rows = []
    for length, is_truncated in zip(response_lengths, truncated, strict=True):
        rows.append(
            {
                "input_ids": [1, 2] + [3] * length,
                "loss_mask": [0, 0] + [1] * length,
                "is_truncated": is_truncated,
                "reward": 1.0,
            }
        )
    return Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def test_config_penalties_read_response_lengths():
    batch = _batch()
    config = OverlongConfig(buffer_tokens=2)
    # max_new_tokens 6: free up to 4; lengths 3, 6, 6, 1 -> 0, -1, -1, 0.
    assert config.compute_penalties(batch, max_new_tokens=6).tolist() == [0.0, -1.0, -1.0, 0.0]
    off = OverlongConfig().compute_penalties(batch, max_new_tokens=6)
    assert off.tolist() == [0.0] * 4


def test_filter_masks_truncated_rows_out_of_every_aggregation():
    batch = _batch()
    assert mask_truncated_responses(batch) == 2
    assert batch["loss_mask"].sum(-1).tolist() == [3, 0, 0, 1]
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        loss = PolicyLoss(aggregation=aggregation, max_response_tokens=6)
        expected = {"token_mean": 4, "seq_mean_token_mean": 2, "seq_mean_token_sum_norm": 12}
        assert loss.count_units(batch).item() == expected[aggregation]


def test_truncation_metrics_count_every_response():
    metrics = compute_truncation_metrics(_batch())
    assert metrics == {"response/truncated_frac": 0.5, "response/num_truncated": 2.0}
    empty = compute_truncation_metrics(_batch().select([]))
    assert empty["response/truncated_frac"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"buffer_tokens": -1}, "buffer_tokens", id="negative-buffer"),
        pytest.param({"penalty_factor": float("inf")}, "penalty_factor", id="inf-factor"),
        pytest.param({"should_filter_truncated": 1}, "should_filter_truncated", id="int-flag"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=f"OverlongConfig.{match}"):
        OverlongConfig(**kwargs)


def test_buffer_longer_than_max_new_tokens_is_refused():
    OverlongConfig(buffer_tokens=8).check_rollout(max_new_tokens=8)
    with pytest.raises(ValueError, match=r"OverlongConfig\.buffer_tokens=9 is longer"):
        OverlongConfig(buffer_tokens=9).check_rollout(max_new_tokens=8)
