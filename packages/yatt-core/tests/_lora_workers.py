"""LoRA policy scenarios on several gloo ranks; run one per rank by test_lora_distributed.py.

    python _lora_workers.py PARALLEL OUT_DIR MODEL_DIR     (torchrun-style env vars set)

Each rank trains its shard of _workers.make_global_batch() for two steps with a LoRA policy,
checkpoints it (yatt.ckpt, every rank writing its shards), takes a third step, then loads the
checkpoint into a fresh policy and takes that third step again; it writes what it saw to
OUT_DIR/rank{R}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _workers import SHARDS, make_global_batch

from yatt.core import LoraConfig, PolicyLoss, TorchPolicy, TorchPolicyConfig, init_runtime

RANK, ALPHA = 4, 8.0


def lora_config(
    model_dir: str, parallel: str, max_tokens: int, modules_to_save: tuple[str, ...] = ()
) -> TorchPolicyConfig:
    return TorchPolicyConfig(
        model_dir=model_dir,
        lr=1e-2,
        grad_clip=None,
        dtype="float32",
        parallel=parallel,
        max_tokens_per_microbatch=max_tokens,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, modules_to_save=modules_to_save),
    )


def run_lora_steps(policy: TorchPolicy, batch, num_steps: int = 2) -> dict:
    """The reference pass first (before any train step: the adapter's first unshard under
    FSDP2 happens with it off), then `num_steps` steps on the same batch."""
    reference = policy.reference_logprobs(batch)
    metrics = []
    for _ in range(num_steps):
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
        metrics.append(policy.train_step(batch, PolicyLoss()))
    return {
        "reference": reference,
        "metrics": metrics,
        "merged": {n: t.cpu().clone() for n, t in policy.named_weights()},
        "adapter": {n: t.cpu().clone() for n, t in policy.named_adapter_weights()},
        "num_optimizer_params": sum(len(g["params"]) for g in policy.optimizer.param_groups),
        "live": live_adapter(policy),
    }


def live_adapter(policy: TorchPolicy) -> str:
    """ "parameters" when named_adapter_weights(live=True) yields the trained parameters
    themselves (what an engine binds); else the ValueError's text (FSDP2: shards)."""
    trained = {id(p) for p in policy.module.parameters() if p.requires_grad}
    try:
        pairs = list(policy.named_adapter_weights(live=True))
    except ValueError as error:
        return str(error)
    is_live = all(id(t) in trained for n, t in pairs if not n.endswith(".lora_scaling"))
    return "parameters" if is_live and pairs else "not the parameters"


def main() -> None:
    parallel, out_dir, model_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    modules_to_save = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ()
    with init_runtime(seed=0) as rt:
        batch = make_global_batch().select(SHARDS[rt.dp_size][rt.dp_rank])
        config = lora_config(model_dir, parallel, max_tokens=24, modules_to_save=modules_to_save)
        policy = TorchPolicy(config, rt)
        out = run_lora_steps(policy, batch)
        from yatt.ckpt import Checkpointer

        with Checkpointer(out_dir / "ckpts", async_save=False) as checkpointer:
            checkpointer.save(2, policy.state(), extra={"step": 2})
            third = run_lora_steps(policy, batch, num_steps=1)
            resumed = TorchPolicy(config, rt)
            checkpointer.load(resumed.state())
            again = run_lora_steps(resumed, batch, num_steps=1)
        out["third"], out["resumed_third"] = third["adapter"], again["adapter"]
        dist.barrier()
        torch.save(out, out_dir / f"rank{rt.rank}.pt")


if __name__ == "__main__":
    main()
