"""One gloo rank of test_offpolicy_versions.py's distributed check: per-token policy versions
follow their samples through Batch.rebalance and restore, and compute_staleness_metrics sums
tokens by age over the ranks.

    python _offpolicy_ranks_worker.py        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from yatt.core import compute_staleness_metrics, rollout_batch, rollout_samples

CURRENT, BOUND = 6, 3


@dataclass
class Completion:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


def versions_of(rank: int, i: int, num_tokens: int) -> list[int]:
    # A pure function of the sample's identity; samples with odd i span two versions.
    first = CURRENT - (rank + i) % (BOUND + 1)
    return [first] * (num_tokens - 1) + [min(first + i % 2, CURRENT)]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Rank 1 holds many long samples, rank 0 few short ones: the rebalance must move some.
    num_samples = 2 if rank == 0 else 8
    completions, versions = [], []
    for i in range(num_samples):
        num_tokens = 2 + i + 6 * rank
        completions.append(
            Completion([rank, i], list(range(10, 10 + num_tokens)), [-0.5] * num_tokens)
        )
        versions.append(versions_of(rank, i, num_tokens))
    groups = [rank * 100 + i // 2 for i in range(num_samples)]
    batch = rollout_batch(
        rollout_samples(completions, [0.0] * num_samples, groups, policy_versions=versions)
    )
    moved, plan = batch.rebalance(group_key="group_id")
    num_moved_in = 0
    for row in moved.to_samples():
        origin, i = row["input_ids"][:2].tolist()
        num_moved_in += origin != rank
        response = row["policy_version"][row["loss_mask"] > 0].tolist()
        assert response == versions_of(origin, i, len(response)), (origin, i, response)
    back = moved.restore(plan)
    assert torch.equal(back.tokens["policy_version"], batch.tokens["policy_version"])
    moved_total = torch.tensor([num_moved_in])
    dist.all_reduce(moved_total)
    assert moved_total.item() > 0, "the rebalance moved nothing: the check checked nothing"

    # Tokens by age, summed over ranks, against a count made from the identities alone.
    metrics = compute_staleness_metrics(moved, current_version=CURRENT, max_staleness=BOUND)
    expected = [0] * (BOUND + 1)
    for r in range(world):
        for i in range(2 if r == 0 else 8):
            for v in versions_of(r, i, 2 + i + 6 * r):
                expected[CURRENT - v] += 1
    got = [metrics[f"offpolicy/tokens_age_{a}"] for a in range(BOUND + 1)]
    assert got == expected, (got, expected)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
