"""One rank of test_export's two-rank scenario (run by yatt.testing.run_ranks, gloo on CPU).

    python _export_workers.py '{"parallel": "fsdp2", "model_dir": ..., "out": ...}'

One train step under DDP or FSDP2, then export_hf awake (OUT/awake), again there (refused on
every rank: the folder exists), asleep (OUT/asleep), and a DCP checkpoint of policy.state()["model"] written by both ranks (OUT/ckpt). Each rank
saves the full weights it saw after the step to OUT/rank{R}.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from yatt.core import (
    Batch,
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    export_hf,
    init_runtime,
)


def make_batch(lengths=(9, 14, 6, 11), seed: int = 0, prompt_len: int = 3) -> Batch:
    """Random samples, two per GRPO group, the loss after `prompt_len` tokens, advantages
    set (test_export.py builds its batches here too)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[prompt_len:] = 1
        ids = torch.randint(5, 200, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "group_id": i // 2, "reward": i % 3})
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def main() -> None:
    kwargs = json.loads(sys.argv[1])
    out = Path(kwargs["out"])
    with init_runtime(seed=0) as rt:
        config = TorchPolicyConfig(
            model_dir=kwargs["model_dir"], lr=1e-2, dtype="float32", parallel=kwargs["parallel"]
        )
        policy = TorchPolicy(config, rt)
        batch = make_batch(seed=rt.rank)
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
        policy.train_step(batch, PolicyLoss(kl_coef=0.0))
        weights = {name: t.clone() for name, t in policy.named_weights()}
        returned = export_hf(policy, out / "awake")
        try:  # rank 0 refuses an existing folder: every rank raises, none waits in a gather
            export_hf(policy, out / "awake")
            refusal = None
        except ValueError as e:
            refusal = str(e)
        dcp.save({"model": get_model_state_dict(policy.module)}, checkpoint_id=out / "ckpt")
        policy.sleep()
        export_hf(policy, out / "asleep")
        dist.barrier()
        result = {"weights": weights, "returned": str(returned), "refusal": refusal}
        torch.save(result, out / f"rank{rt.rank}.pt")


if __name__ == "__main__":
    main()
