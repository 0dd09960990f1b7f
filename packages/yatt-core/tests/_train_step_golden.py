"""Golden outputs of TorchPolicy's train step, first recorded before the shared train-step
skeleton.

    python tests/_train_step_golden.py write      # regenerate tests/golden/train_step.json

Regenerate only for an intended numeric change, and say why in the commit. The record holds,
per case, every train_step metric (exact floats), a sha256 of the logprobs and of the updated
weights, and each weight's float64 sum (for a readable diff when a hash changes). Cases: one
process (several micro-batches; DAPO over 2 mini-batches x 2 epochs with old logprobs taken
once, so the ratio leaves 1 and the clip acts, with a rollout correction; both aggregations;
on-policy; bf16; a non-finite skip; an empty batch) and two gloo ranks (DDP and FSDP2, uneven
shards). Every case runs in a subprocess with one thread (run_ranks sets OMP_NUM_THREADS=1), so
the numbers do not depend on the pytest process's thread count.

Regenerated (issue 24) when the loss family came in: PolicyLoss() became GRPO's
seq_mean_token_mean, advantages take eps 1e-4, and "token_mean_clipped" became several
optimizer steps per rollout batch (its clip had never acted: one step per batch, ratio 1).

    python tests/_train_step_golden.py single OUT_DIR MODEL_DIR   # what `write` runs per rank
    python tests/_train_step_golden.py ranks OUT_DIR MODEL_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden") / "train_step.json"
SHARDS = [[0, 1, 2, 3, 4], [5]]  # uneven: rank 1 runs dummy micro-batches


def fingerprint() -> dict:
    """What the exact numbers depend on besides the code: library versions and CPU kernels."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def make_model(path: Path) -> str:
    from yatt.testing import make_tiny_causal_lm

    make_tiny_causal_lm(path, arch="llama", max_position_embeddings=64, seed=0)
    return str(path)


def make_batch(lengths=(9, 17, 5, 12, 20, 7), seed: int = 0):
    from yatt.core import Batch, compute_grpo_advantages

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
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


def tensor_sha(tensors: dict[str, torch.Tensor] | torch.Tensor) -> str:
    digest = hashlib.sha256()
    items = tensors.items() if isinstance(tensors, dict) else [("", tensors)]
    for name, tensor in items:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def record_policy(policy, steps: list[dict]) -> dict:
    weights = {name: t.detach().cpu().clone() for name, t in policy.named_weights()}
    return {
        "steps": steps,
        "weights_sha": tensor_sha(weights),
        "weight_sums": {name: float(t.double().sum()) for name, t in weights.items()},
    }


def run_mini_batch_steps(policy, batch, loss_fn) -> dict:
    """loss_fn.num_epochs passes of loss_fn.num_mini_batches train steps over `batch`, old
    logprobs taken once before the first: the trainer's order of operations."""
    from yatt.core import split_mini_batches

    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    logprobs_sha = [tensor_sha(batch["old_logprobs"])]
    # The engine's logprobs: the old ones, off by up to +-1 on loss tokens (seeded), so the
    # rollout correction truncates some tokens at its cap.
    gen = torch.Generator().manual_seed(1)
    noise_BT = (torch.rand(batch["old_logprobs"].shape, generator=gen) * 2 - 1) * batch["loss_mask"]
    batch.tokens["rollout_logprobs"] = batch["old_logprobs"] + noise_BT
    costs = policy.estimate_costs(batch.lengths.tolist())
    mini_batches = split_mini_batches(batch, loss_fn.num_mini_batches, costs=costs)
    steps = [
        policy.train_step(mb, loss_fn) for _ in range(loss_fn.num_epochs) for mb in mini_batches
    ]
    return record_policy(policy, steps) | {"logprobs_sha": logprobs_sha}


def run_steps(policy, batch, loss_fn, num_steps: int) -> dict:
    """`num_steps` train steps, old logprobs recomputed before each (unless on-policy)."""
    steps, logprobs_sha = [], []
    for _ in range(num_steps):
        if not loss_fn.is_on_policy:
            batch.tokens["old_logprobs"] = policy.logprobs(batch)
            logprobs_sha.append(tensor_sha(batch["old_logprobs"]))
        steps.append(policy.train_step(batch, loss_fn))
    return record_policy(policy, steps) | {"logprobs_sha": logprobs_sha}


def _config(model_dir: str, **overrides):
    from yatt.core import TorchPolicyConfig

    base = {
        "model_dir": model_dir,
        "lr": 1e-3,
        "dtype": "float32",
        "parallel": "none",
        "grad_clip": 1.0,
        "max_tokens_per_microbatch": 13,
    }
    return TorchPolicyConfig(**(base | overrides))


def single_cases(model_dir: str) -> dict:
    from yatt.core import PolicyLoss, TorchPolicy

    out = {}
    policy = TorchPolicy(_config(model_dir, lr=2e-2))
    loss = PolicyLoss(objective="dapo", entropy_coef=0.01, num_mini_batches=2, num_epochs=2)
    out["token_mean_clipped"] = run_mini_batch_steps(policy, make_batch(), loss)

    policy = TorchPolicy(_config(model_dir, grad_clip=None, max_tokens_per_microbatch=4096))
    loss = PolicyLoss(
        aggregation="seq_mean_token_mean",
        rollout_correction="none",
        is_on_policy=True,
        should_compute_entropy=True,
        dual_clip_c=3.0,
    )
    out["seq_mean_on_policy"] = run_steps(policy, make_batch(), loss, 2)

    policy = TorchPolicy(_config(model_dir, dtype="bfloat16", gradient_checkpointing=True))
    loss = PolicyLoss(objective="dapo", rollout_correction="none")
    out["bf16_checkpointed"] = run_steps(policy, make_batch(), loss, 1)

    policy = TorchPolicy(_config(model_dir, max_tokens_per_microbatch=24))
    batch = make_batch()
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    batch.samples["advantages"][1] = float("nan")
    loss = PolicyLoss(rollout_correction="none")
    skipped = policy.train_step(batch, loss)
    batch.samples["advantages"][1] = 0.5
    healthy = policy.train_step(batch, loss)
    empty = policy.train_step(make_batch().select([]), loss)
    out["skips"] = record_policy(policy, [skipped, healthy, empty]) | {
        "num_steps": policy.num_steps,
        "num_skipped_steps": policy.num_skipped_steps,
    }
    return out


def rank_cases(model_dir: str, rt) -> dict:
    from yatt.core import PolicyLoss, TorchPolicy

    out = {}
    for parallel in ("ddp", "fsdp2"):
        policy = TorchPolicy(
            _config(model_dir, parallel=parallel, max_tokens_per_microbatch=24), rt
        )
        batch = make_batch().select(SHARDS[rt.dp_rank])
        loss = PolicyLoss(objective="dapo", rollout_correction="none")
        out[parallel] = run_steps(policy, batch, loss, 2)
    return out


def _worker(mode: str, out_dir: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    if mode == "single":
        result = single_cases(model_dir)
        rank = 0
    else:
        from yatt.core import init_runtime

        with init_runtime(device="cpu", seed=0) as rt:
            result = rank_cases(model_dir, rt)
            rank = rt.rank
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def compute_record(model_dir: str, work_dir: Path) -> dict:
    """Every case, each in its own subprocess(es): {"single": ..., "ranks": [rank0, rank1]}."""
    from yatt.testing import run_ranks

    record: dict = {}
    for mode, world_size in (("single", 1), ("ranks", 2)):
        out_dir = work_dir / mode
        out_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, __file__, mode, str(out_dir), model_dir]
        run_ranks(args, world_size, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=300)
        ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
        record[mode] = ranks[0] if world_size == 1 else ranks
    return record


def main() -> None:
    if sys.argv[1] in ("single", "ranks"):
        _worker(*sys.argv[1:4])
        return
    assert sys.argv[1] == "write", __doc__
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model")
        record = compute_record(model_dir, Path(tmp) / "out")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"fingerprint": fingerprint(), **record}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
