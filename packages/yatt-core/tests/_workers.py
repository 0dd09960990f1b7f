"""Multi-process scenarios for the distributed tests; run one per rank by conftest's `launch`.

    python _workers.py SCENARIO OUT_DIR KWARGS_JSON     (torchrun-style env vars set)

Each rank writes its observations to OUT_DIR/rank{R}.pt; the tests assert on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from yatt.core import (
    Batch,
    PolicyLoss,
    ShardedLoader,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    init_runtime,
    reduce_metrics,
    sample_dynamically,
)

# Which of the global batch's samples each rank holds: uneven on purpose, so one rank runs
# dummy micro-batches to keep collectives in step.
SHARDS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1, 2, 3, 4], [5]]}


def make_global_batch(seed: int = 0) -> Batch:
    """Six samples of different lengths, two per GRPO group, with advantages."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate([9, 17, 5, 12, 20, 7]):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[3:] = 1
        rows.append(
            {
                "input_ids": torch.randint(5, 200, (length,), generator=gen),
                "loss_mask": mask,
                "group_id": i // 2,
                "reward": float(torch.rand((), generator=gen)),
            }
        )
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def policy_config(model_dir: str, parallel: str, max_tokens: int) -> TorchPolicyConfig:
    return TorchPolicyConfig(
        model_dir=model_dir,
        lr=1e-3,
        grad_clip=None,
        dtype="float32",
        parallel=parallel,
        max_tokens_per_microbatch=max_tokens,
    )


def run_policy_step(policy: TorchPolicy, batch: Batch, loss_fn: PolicyLoss) -> dict:
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    # A sleep/wake cycle before the step must not change its result; on CUDA it frees memory.
    freed = 0
    if policy.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    policy.sleep()
    if policy.device.type == "cuda":
        freed = before - torch.cuda.memory_allocated()
    policy.wake_up()
    metrics = policy.train_step(batch, loss_fn)
    # Bytes of this rank's parameters (its shards under FSDP2), freed by the sleep above.
    local = [p.to_local() if hasattr(p, "to_local") else p for p in policy.module.parameters()]
    local_bytes = sum(t.nbytes for t in local)
    weights = {name: t.cpu().clone() for name, t in policy.named_weights()}
    return {
        "metrics": metrics,
        "weights": weights,
        "old_logprobs": batch["old_logprobs"],
        "freed_bytes": freed,
        "param_bytes": local_bytes,
    }


def scenario_policy(rt, out: dict, *, model_dir: str, runs: list) -> None:
    import yatt.core.policy._head_logprobs as head_logprobs

    # Logprobs in the head, several chunks per micro-batch: DDP and FSDP2 must see the head
    # weight's gradient once, summed over the chunks' recomputes.
    head_logprobs.CHUNK_ELEMENTS = 2048
    # Several (parallel, aggregation) runs share one launch: process start-up dominates.
    for parallel, aggregation in runs:
        batch = make_global_batch().select(SHARDS[rt.dp_size][rt.dp_rank])
        policy = TorchPolicy(policy_config(model_dir, parallel, max_tokens=24), rt)
        loss_fn = PolicyLoss(aggregation=aggregation, clip_high=0.28)
        out[parallel, aggregation] = run_policy_step(policy, batch, loss_fn)
    # A rank with no samples at all still takes part (all dummy micro-batches).
    empty = batch.select([]) if rt.dp_rank == 1 else batch
    out["logprobs_with_empty_rank"] = policy.logprobs(empty)


def scenario_controller(rt, out: dict, *, data: str, batch_size: int) -> None:
    """Each rank loads its own shard, rebalances by length, restores; records what it held."""
    loader = ShardedLoader(
        data,
        batch_size=batch_size,
        rank=rt.dp_rank,
        world_size=rt.dp_size,
        image_key="image",
        should_open_images=False,  # the payload is hex bytes, decoded below
    )
    rows = loader.next_batch()
    own = [row["_index"] for row in rows]
    out["own"] = own
    out["num_rows_parsed"] = loader.num_rows_parsed
    # Lengths skewed by rank so balancing has to move samples.
    samples = [
        {
            "input_ids": torch.arange(4 + (40 if rt.dp_rank == 0 else 2) + i % 3),
            "row": row["_index"],
            "image": np.frombuffer(bytes.fromhex(row["image"]), dtype=np.uint8),
        }
        for i, row in enumerate(rows)
    ]
    batch = Batch.from_samples(samples)
    balanced, plan = batch.rebalance(group=rt.dp_group)
    out["held"] = balanced["row"].tolist()
    out["held_images_ok"] = all(
        bytes(img.tobytes()).hex() == _image_hex(r)
        for img, r in zip(balanced["image"], out["held"], strict=True)
    )
    out["tokens_before"] = batch.num_tokens
    out["tokens_after"] = balanced.num_tokens
    # tolerance reaches yatt.balance: a 5% imbalance stays at 0.1 and is evened out at 0.
    lengths = [11, 11, 10, 10] if rt.dp_rank == 0 else [10, 10, 9, 9]
    small = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
    for tolerance in (0.1, 0.0):
        got, _ = small.rebalance(group=rt.dp_group, tolerance=tolerance)
        out[f"tokens_at_tolerance_{tolerance}"] = got.num_tokens
    balanced.samples["score"] = balanced["row"].to(torch.float32) * 2
    back = balanced.restore(plan, group=rt.dp_group)
    out["restored_rows"] = back["row"].tolist()
    out["restored_scores"] = back["score"].tolist()
    out["metrics"] = reduce_metrics(
        {"n": float(len(rows)), "rank": float(rt.dp_rank)},
        group=rt.dp_group,
        ops={"n": "sum", "rank": "max"},
    )
    # Dynamic sampling: rank 0's groups always have variance, rank 1's only every third round.
    rounds = []

    def generate(num_missing: int) -> Batch:
        rounds.append(num_missing)
        informative = rt.dp_rank == 0 or len(rounds) % 3 == 0
        rewards = [0.0, 1.0] if informative else [1.0, 1.0]
        return Batch.from_samples(
            [{"input_ids": [1, 2], "group_id": 0, "reward": r} for r in rewards]
        )

    _, stats = sample_dynamically(generate, num_groups=2, max_rounds=10, group=rt.dp_group)
    out["ds_rounds"] = rounds
    out["ds_stats"] = stats


def _image_hex(row: int) -> str:
    return bytes([(row * 7 + k) % 256 for k in range(64)]).hex()


def main() -> None:
    scenario, out_dir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    out: dict = {}
    with init_runtime(seed=0) as rt:
        globals()[f"scenario_{scenario}"](rt, out, **kwargs)
        dist.barrier()
        torch.save(out, out_dir / f"rank{rt.rank}.pt")


if __name__ == "__main__":
    main()
