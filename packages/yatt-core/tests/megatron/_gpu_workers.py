"""GPU checks of MegatronPolicy, one process per GPU under torchrun; rank 0 writes a JSON.

    torchrun --nproc-per-node N _gpu_workers.py --tp TP --model-dirs JSON --out FILE [--torch-ref]

Per model family (a saved HF checkpoint each), on the same global batch:
- logprobs: Megatron (bf16) vs the HF model in float32 on valid tokens; also the raw
  per-token logprobs, so the caller can compare TP=2 with TP=1;
- train: two train_step losses (PolicyLoss with an entropy bonus); with --torch-ref also
  TorchPolicy's two losses on the same batch;
- weights: named_weights() vs the HF weights cast to bf16, bitwise;
- sleep: bytes allocated before/after sleep(), and logprobs after wake_up() vs before;
- ckpt: save with yatt.ckpt, take a step, load, and compare every weight bitwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist


def _global_batch(vocab_size: int, *, num_samples: int = 8, seed: int = 0):
    from yatt.core import Batch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_samples):
        length = int(torch.randint(24, 120, (1,), generator=gen))
        ids = torch.randint(5, vocab_size, (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.int64)
        mask[length // 2 :] = 1
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": mask,
                "advantages": float(1 - 2 * (i % 2)),
                "sample_id": i,
            }
        )
    return Batch.from_samples(rows, token_keys=("input_ids", "loss_mask"))


def _hf_logprobs(model_dir: str, batch, device) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from yatt.core import compute_token_logprobs

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        b = batch.to(device)
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        out = compute_token_logprobs(logits, b["input_ids"]) * b["attention_mask"]
    del hf
    return out.cpu()


def _masked_stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    diff = (a - b).abs()[mask.bool()]
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


def _policy_cuda_bytes(policy) -> int:
    """Bytes of the CUDA storages the policy owns, counted from its objects (not from the
    allocator): DDP's parameter and gradient buffers, the parameters themselves (views into
    those buffers, or their own storage without one), and the optimizer's fp32 main
    parameters and Adam state. Each storage once."""
    tensors = [p for model in policy.models for p in model.parameters()]
    if policy.optimizer is not None:
        # Megatron DDP's contiguous buffers (param_data is None without the distributed
        # optimizer); `_buffers()` is the list sleep() offloads.
        for buffer in policy._buffers():
            tensors += [buffer.param_data, buffer.grad_data]
        inner = policy._inner_optimizer.optimizer  # the torch Adam inside Megatron's wrapper
        for group in inner.param_groups:
            tensors += list(group["params"])
        for state in inner.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _warm_up_cublas(device) -> None:
    """Create cuBLAS's workspaces before the baseline: one per (handle, stream), and a handle
    per thread, so a bf16 matmul on this thread AND its backward (autograd's device thread) run
    once. The workspaces stay allocated for the process's life (64 MiB each on an H200)."""
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    torch.cuda.synchronize(device)
    del a


def check_family(arch: str, model_dir: str, rt, *, torch_ref: bool, attention: str) -> dict:
    from yatt.ckpt import Checkpointer
    from yatt.core import PolicyLoss, TorchPolicy, TorchPolicyConfig
    from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig

    config = MegatronPolicyConfig(
        model_dir=model_dir,
        tp_size=rt.tp_size,
        lr=1e-4,
        attention=attention,
        weight_sync_bucket_bytes=1 << 20,
    )
    # What this process holds before the policy (reported, for the record). cuBLAS's
    # workspaces belong to it: made here, not by the policy's first matmul.
    _warm_up_cublas(rt.device)
    gc.collect()
    torch.cuda.empty_cache()
    allocated_baseline = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    policy = MegatronPolicy(config, rt)
    build_s = time.perf_counter() - t0
    global_batch = _global_batch(policy.layout.vocab_size)
    # This DP rank's share; TP ranks of one DP rank hold the same samples.
    batch = global_batch.select(list(range(rt.dp_rank, len(global_batch), rt.dp_size)))
    out: dict = {"arch": arch, "build_s": build_s}

    # Weight export before any step: bf16 of the HF fp32 weights, bitwise.
    from safetensors.torch import load_file

    hf_state = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = dict(policy.named_weights())
    expected = {
        k: v for k, v in hf_state.items() if not (policy.layout.is_tied and k == "lm_head.weight")
    }
    out["weights_names_equal"] = set(exported) == set(expected)
    out["weights_bitwise_equal"] = out["weights_names_equal"] and all(
        torch.equal(exported[k].cpu(), v.to(exported[k].dtype)) for k, v in expected.items()
    )
    del exported

    logprobs = policy.logprobs(batch).cpu()
    ref = _hf_logprobs(model_dir, batch, rt.device)
    out["logprobs_vs_hf"] = _masked_stats(logprobs, ref, batch["attention_mask"])
    out["logprobs"] = {
        int(i): lp[: int(n)].tolist()
        for i, lp, n in zip(batch["sample_id"], logprobs, batch.lengths, strict=True)
    }

    loss_fn = PolicyLoss(entropy_coef=0.01)
    batch.tokens["old_logprobs"] = logprobs
    losses = []
    for _ in range(2):
        metrics = policy.train_step(batch, loss_fn)
        losses.append(metrics["loss"])
    out["megatron_losses"] = losses
    out["grad_norm"] = metrics["grad_norm"]

    # Sleep frees the GPU; wake-up restores the same function.
    before = policy.logprobs(batch).cpu()
    torch.cuda.synchronize()
    allocated_awake = torch.cuda.memory_allocated()
    policy_bytes = _policy_cuda_bytes(policy)
    policy.sleep()
    torch.cuda.synchronize()
    allocated_asleep = torch.cuda.memory_allocated()
    policy.wake_up()
    after = policy.logprobs(batch).cpu()
    out["sleep"] = {
        "allocated_baseline_bytes": allocated_baseline,
        "allocated_awake_bytes": allocated_awake,
        "allocated_asleep_bytes": allocated_asleep,
        "policy_bytes": policy_bytes,
        "logprobs_bitwise_after_wake": bool(torch.equal(before, after)),
    }
    metrics = policy.train_step(batch, loss_fn)
    out["loss_after_wake"] = metrics["loss"]

    # Checkpoint round trip through yatt.ckpt.
    ckpt_dir = tempfile.mkdtemp(prefix="yatt-mg-ckpt-") if rt.rank == 0 else None
    holder = [ckpt_dir]
    dist.broadcast_object_list(holder, src=0)
    ckpt = Checkpointer(holder[0], async_save=False)
    ckpt.save(1, policy.state())
    snapshot = {
        k: v.detach().clone()
        for k, v in policy.chunks[0].model.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    # Two steps from the saved state, then the same two after loading it: the second step's
    # loss depends on the restored optimizer state, the first only on the weights.
    continued = [policy.train_step(batch, loss_fn)["loss"] for _ in range(2)]
    ckpt.load(policy.state())
    ckpt.close()
    out["ckpt_weights_bitwise"] = all(
        torch.equal(v, snapshot[k])
        for k, v in policy.chunks[0].model.state_dict().items()
        if isinstance(v, torch.Tensor)
    )
    resumed = [policy.train_step(batch, loss_fn)["loss"] for _ in range(2)]
    out["ckpt_loss_resumed_vs_continued"] = [resumed, continued]

    if torch_ref:
        tp = TorchPolicy(TorchPolicyConfig(model_dir=model_dir, lr=1e-4, parallel="ddp"), rt)
        batch.tokens["old_logprobs"] = logprobs
        out["torch_losses"] = [tp.train_step(batch, loss_fn)["loss"] for _ in range(2)]
        del tp
    del policy
    torch.cuda.empty_cache()
    return out


def check_packing(model_dir: str, rt) -> dict:
    """pack_sequences=True against the padded layout on the same batch, from the same weights:
    logprobs and one train step's loss (bf16: per-row and batched SDPA kernels round apart)."""
    from yatt.core import PolicyLoss
    from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig

    out: dict = {}
    for pack in (False, True):
        config = MegatronPolicyConfig(
            model_dir=model_dir, tp_size=rt.tp_size, lr=1e-4, pack_sequences=pack
        )
        policy = MegatronPolicy(config, rt)
        batch = _global_batch(policy.layout.vocab_size)
        logprobs = policy.logprobs(batch)
        batch.tokens["old_logprobs"] = logprobs
        metrics = policy.train_step(batch, PolicyLoss())
        out[pack] = {
            "logprobs": logprobs.cpu(),
            "metrics": metrics,
            "mask": batch["attention_mask"],
        }
        del policy
        gc.collect()
        torch.cuda.empty_cache()
    stats = _masked_stats(out[True]["logprobs"], out[False]["logprobs"], out[False]["mask"].cpu())
    return {
        "logprobs_packed_vs_padded": stats,
        "loss_padded": out[False]["metrics"]["loss"],
        "loss_packed": out[True]["metrics"]["loss"],
        "num_padding_tokens_saved": out[True]["metrics"]["num_padding_tokens_saved"],
    }


def check_recompute(model_dir: str, rt) -> dict:
    """Full activation recompute (uniform, 1 layer) against none, from the same weights on the
    same batch, bf16: one train step's loss and gradient norm, and the step's peak memory
    above what was allocated before it (the activations kept for the backward)."""
    from yatt.core import PolicyLoss
    from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig

    out: dict = {}
    for granularity in (None, "full"):
        config = MegatronPolicyConfig(
            model_dir=model_dir,
            tp_size=rt.tp_size,
            lr=1e-4,
            recompute_granularity=granularity,
        )
        policy = MegatronPolicy(config, rt)
        batch = _global_batch(policy.layout.vocab_size)
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
        torch.cuda.synchronize(rt.device)
        before = torch.cuda.memory_allocated(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
        metrics = policy.train_step(batch, PolicyLoss())
        torch.cuda.synchronize(rt.device)
        out[str(granularity)] = {
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "step_peak_bytes": torch.cuda.max_memory_allocated(rt.device) - before,
            "tf_granularity": policy.chunks[0].model.config.recompute_granularity,
        }
        del policy
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model-dirs", required=True, help="JSON {arch: dir}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--torch-ref", action="store_true")
    parser.add_argument("--pack-check", action="store_true")
    parser.add_argument("--recompute-check", action="store_true")
    args = parser.parse_args()

    from yatt.core import init_runtime

    results = {"tp": args.tp, "world_size": int(os.environ.get("WORLD_SIZE", 1)), "families": {}}
    with init_runtime(tp_size=args.tp) as rt:
        results["dp"] = rt.dp_size
        for arch, model_dir in json.loads(args.model_dirs).items():
            results["families"][arch] = check_family(
                arch,
                model_dir,
                rt,
                torch_ref=args.torch_ref and rt.tp_size == 1,
                attention=args.attention,
            )
        if args.pack_check:
            (model_dir,) = json.loads(args.model_dirs).values()
            results["packing"] = check_packing(model_dir, rt)
        if args.recompute_check:
            (model_dir,) = json.loads(args.model_dirs).values()
            results["recompute"] = check_recompute(model_dir, rt)
        if rt.is_rank_zero:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()


if __name__ == "__main__":
    main()
