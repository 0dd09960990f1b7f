"""Group-relative advantages (GRPO) and the zero-variance group filter (DAPO dynamic sampling).

Shape legend (suffixes on tensor names):
    B  samples; each belongs to one group (the n responses to one prompt)
    G  distinct groups present in the batch
Groups are given by `group_ids_B` (any integers); members need not be contiguous. A whole group
lives on one rank (the rollout keeps it there), so everything here is local: no collective.
"""

from __future__ import annotations

import torch

# TRL divides by std + 1e-4 (grpo_trainer.py); verl by std + 1e-6, which lets a group whose
# rewards differ only by float noise (1e-5) reach |A| ~ 1.9.
DEFAULT_ADVANTAGE_EPS = 1e-4
# eps above this would shrink every advantage of 0/1 rewards (std up to 0.5) by a third or
# more: no longer a guard of the division but a change of the objective.
MAX_ADVANTAGE_EPS = 0.1
# Rewards of one group closer than this are equal: advantage 0 (and no variance for DAPO's
# dynamic sampling). Far below any real difference of a rule or a judge's vote mean (1/votes).
DEFAULT_ZERO_VARIANCE_TOLERANCE = 1e-4


def _group_index(group_ids_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    if group_ids_B.dim() != 1:
        raise ValueError(f"group_ids_B must be 1-D [B], got shape {tuple(group_ids_B.shape)}")
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(index_B.max()) + 1 if index_B.numel() else 0
    return index_B, num_groups


def compute_grpo_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    *,
    should_std_normalize: bool = True,
    eps: float = DEFAULT_ADVANTAGE_EPS,
    zero_variance_tolerance: float = DEFAULT_ZERO_VARIANCE_TOLERANCE,
) -> torch.Tensor:
    """Advantage of each sample relative to its group, [B] in float32.

    GRPO outcome supervision (arXiv:2402.03300, sec. 4.1.2): A_i = (r_i - mean(r)) / (std(r) +
    eps) over the group, the same value for every token of response i. should_std_normalize=False
    drops the division (Dr. GRPO, arXiv:2503.20783, sec. 3.1), which removes the bias toward
    groups whose rewards barely differ. std is the unbiased sample std (as in TRL and verl).

    A group of one sample, or whose rewards all lie within `zero_variance_tolerance` of each
    other (max - min <= tolerance), gets advantage 0: it holds no preference between its
    responses, only float noise (a GenRM's scores can differ by 1e-5 for equal verdicts), which
    the division by std would otherwise blow up to a full-size advantage. `eps` (TRL's 1e-4)
    bounds the division for groups just above the tolerance.
    """
    if rewards_B.shape != group_ids_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and group_ids_B {tuple(group_ids_B.shape)} "
            "must have the same shape [B]"
        )
    if not torch.isfinite(rewards_B).all():
        raise ValueError("rewards_B holds non-finite values; fix the reward function's output")
    if not 0.0 < eps <= MAX_ADVANTAGE_EPS:
        raise ValueError(
            f"eps={eps!r}: must be in (0, {MAX_ADVANTAGE_EPS}]; with eps=0 a group of equal "
            "rewards gives 0 / 0 = NaN advantages (use 1e-4, TRL's, or 1e-6, verl's)"
        )
    if not zero_variance_tolerance >= 0.0:
        raise ValueError(f"zero_variance_tolerance={zero_variance_tolerance!r}: must be >= 0")
    rewards_B = rewards_B.to(torch.float64)
    index_B, num_groups = _group_index(group_ids_B.to(rewards_B.device))
    if num_groups == 0:
        return rewards_B.to(torch.float32)
    count_G = torch.zeros(num_groups, dtype=torch.float64, device=rewards_B.device)
    count_G.index_add_(0, index_B, torch.ones_like(rewards_B))
    sum_G = torch.zeros_like(count_G).index_add_(0, index_B, rewards_B)
    mean_G = sum_G / count_G
    has_variance_B = (
        _reward_ranges(rewards_B, index_B, num_groups)[index_B] > zero_variance_tolerance
    )
    centered_B = torch.where(has_variance_B, rewards_B - mean_G[index_B], 0.0)
    if not should_std_normalize:
        return centered_B.to(torch.float32)
    sq_G = torch.zeros_like(count_G).index_add_(0, index_B, centered_B.square())
    std_G = torch.sqrt(sq_G / (count_G - 1).clamp(min=1.0))
    return (centered_B / (std_G[index_B] + eps)).to(torch.float32)


def _reward_ranges(rewards_B: torch.Tensor, index_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """max - min of each group's rewards, [G] float64."""
    max_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=rewards_B.device)
    min_G = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=rewards_B.device)
    max_G = max_G.scatter_reduce(0, index_B, rewards_B, reduce="amax")
    min_G = min_G.scatter_reduce(0, index_B, rewards_B, reduce="amin")
    return max_G - min_G


def mask_groups_with_reward_variance(
    rewards_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    *,
    tolerance: float = DEFAULT_ZERO_VARIANCE_TOLERANCE,
) -> torch.Tensor:
    """Bool [B]: True for samples whose group's rewards are not all equal.

    DAPO dynamic sampling (arXiv:2503.14476, eq. 11 constraint 0 < |{correct}| < G): a group whose
    responses all score the same has zero advantage everywhere and adds no gradient, only noise
    in the batch size. Rewards within `tolerance` of each other count as equal.
    """
    if rewards_B.shape != group_ids_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and group_ids_B {tuple(group_ids_B.shape)} "
            "must have the same shape [B]"
        )
    index_B, num_groups = _group_index(group_ids_B.to(rewards_B.device))
    if num_groups == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards_B.device)
    rewards_B = rewards_B.to(torch.float64)
    return (_reward_ranges(rewards_B, index_B, num_groups) > tolerance)[index_B]
