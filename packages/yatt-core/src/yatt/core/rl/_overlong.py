"""Overlong responses: the ones the rollout cut at max_new_tokens (finish_reason "length").

A truncated response never reached its answer, so its reward says little about its tokens
(DAPO arXiv:2503.14476, sec. 3.4). Two remedies, both off by default:

    rewards += overlong_penalty(response lengths)     soft punishment (DAPO eq. 13), before
                                                      advantages but AFTER dynamic sampling's
                                                      variance test, which reads the task
                                                      reward (DAPO eq. 11, verl's recipe): an
                                                      all-right group with one overlong
                                                      response has nothing to teach
    mask_truncated_responses(batch)                   overlong filtering: their loss_mask zeroed

`yatt.core.rollout_samples` marks each sample "is_truncated" (a bool sample field), and
`compute_truncation_metrics` gives the run's "response/truncated_frac" either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from yatt.core.data._batch import Batch
from yatt.core.runtime._metrics import reduce_metrics

IS_TRUNCATED_KEY = "is_truncated"


@dataclass(kw_only=True, frozen=True)
class OverlongConfig:
    """What to do with responses cut at the rollout's max_new_tokens (DAPO sec. 3.4)."""

    should_filter_truncated: bool = False  # truncated responses out of the loss (overlong filter)
    buffer_tokens: int = 0  # soft punishment's L_cache (DAPO eq. 13); 0 = off
    penalty_factor: float = 1.0  # the punishment at max_new_tokens is -penalty_factor

    def __post_init__(self) -> None:
        if not isinstance(self.should_filter_truncated, bool):
            raise ValueError(
                f"OverlongConfig.should_filter_truncated={self.should_filter_truncated!r}: "
                "must be a bool"
            )
        if isinstance(self.buffer_tokens, bool) or not isinstance(self.buffer_tokens, int):
            raise ValueError(
                f"OverlongConfig.buffer_tokens={self.buffer_tokens!r}: must be an int >= 0"
            )
        if self.buffer_tokens < 0:
            raise ValueError(
                f"OverlongConfig.buffer_tokens={self.buffer_tokens!r}: must be an int >= 0"
            )
        factor = self.penalty_factor
        if not (factor >= 0.0 and factor < float("inf")):
            raise ValueError(
                f"OverlongConfig.penalty_factor={factor!r}: must be a finite number >= 0"
            )

    def check_rollout(self, *, max_new_tokens: int) -> None:
        """Raise ValueError when the buffer does not fit in the rollout's max_new_tokens."""
        if self.buffer_tokens > max_new_tokens:
            raise ValueError(
                f"OverlongConfig.buffer_tokens={self.buffer_tokens} is longer than "
                f"max_new_tokens={max_new_tokens}: the punishment would start before the first "
                f"token; use at most {max_new_tokens} (DAPO: 4096 of 20480)"
            )

    def compute_penalties(self, batch: Batch, *, max_new_tokens: int) -> torch.Tensor:
        """[B] float32 soft punishment of each sample's response length (0 when off); add it
        to the rewards before advantages. Reads the length from "loss_mask": call it before
        mask_truncated_responses."""
        lengths_B = batch["loss_mask"].sum(-1)
        if self.buffer_tokens == 0:
            return torch.zeros(lengths_B.shape, dtype=torch.float32, device=lengths_B.device)
        return compute_overlong_penalty(
            lengths_B,
            max_response_tokens=max_new_tokens,
            buffer_tokens=self.buffer_tokens,
            penalty_factor=self.penalty_factor,
        )


def compute_overlong_penalty(
    response_lengths_B: torch.Tensor,
    *,
    max_response_tokens: int,
    buffer_tokens: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), [B] float32, times
    penalty_factor. With L_max = max_response_tokens, L_cache = buffer_tokens, |y| a length:

        R_length(y) = 0                                    |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    = -1                                   |y| > L_max
    """
    if not 0 < buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"buffer_tokens={buffer_tokens!r}: must be in 1..max_response_tokens "
            f"({max_response_tokens})"
        )
    lengths_B = response_lengths_B.to(torch.float32)
    expected = float(max_response_tokens - buffer_tokens)
    penalty_B = ((expected - lengths_B) / buffer_tokens).clamp(min=-1.0, max=0.0)
    return penalty_B * penalty_factor


def mask_truncated_responses(batch: Batch) -> int:
    """Zero the loss mask of every truncated response (overlong filtering, DAPO sec. 3.4), in
    place; returns how many rows it masked. Their tokens then count in no loss unit."""
    is_truncated_B = _is_truncated(batch)
    num_masked = int(is_truncated_B.sum())  # host sync: the count is logged
    if num_masked:
        mask_BT = batch.tokens["loss_mask"]
        mask_BT[is_truncated_B.to(mask_BT.device)] = 0
    return num_masked


def compute_truncation_metrics(batch: Batch, *, group: Any = None) -> dict[str, float]:
    """{"response/truncated_frac", "response/num_truncated"} over the batches of every rank
    of `group` (collective; every rank must call it, with rows or without)."""
    is_truncated_B = _is_truncated(batch)
    totals = reduce_metrics(
        {"truncated": float(is_truncated_B.sum()), "responses": float(len(batch))},
        group=group,
        default_op="sum",
    )
    return {
        "response/truncated_frac": totals["truncated"] / max(totals["responses"], 1.0),
        "response/num_truncated": totals["truncated"],
    }


def _is_truncated(batch: Batch) -> torch.Tensor:
    if IS_TRUNCATED_KEY not in batch:
        raise ValueError(
            f"the batch has no {IS_TRUNCATED_KEY!r} field; build it with "
            "yatt.core.rollout_samples from completions that carry finish_reason"
        )
    return batch[IS_TRUNCATED_KEY].to(torch.bool)
