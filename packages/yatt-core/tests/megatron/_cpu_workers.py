"""Scenarios run by test_megatron_cpu.py, one process per tensor-parallel rank (gloo).

    python _cpu_workers.py SCENARIO OUT_DIR JSON_KWARGS      (RANK/WORLD_SIZE/... set)
Each rank writes OUT_DIR/rank<r>.pt with what the test checks.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _cpu_shim


def _setup(tp_size: int):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
        _cpu_shim.install()
    return parallel_state.get_tensor_model_parallel_rank()


def shapes(arch: str) -> dict:
    from yatt.core.policy.megatron._config import layout_from_hf_config, padded_vocab_size
    from yatt.core.policy.megatron._model import build_gpt_model
    from yatt.core.policy.megatron._weights import megatron_shapes
    from yatt.testing import make_tiny_causal_lm

    tp = dist.get_world_size()
    _setup(tp)
    out = {}
    for is_tied in (False, True):
        hf = make_tiny_causal_lm(
            arch=arch, num_heads=8, num_kv_heads=4, tie_word_embeddings=is_tied
        )
        layout = layout_from_hf_config(hf.config)
        model = build_gpt_model(
            layout, tp_size=tp, dtype=torch.float32, use_cpu_initialization=True
        )
        got = {
            k: tuple(v.shape)
            for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        expected = megatron_shapes(
            layout, tp_size=tp, padded_vocab=padded_vocab_size(layout.vocab_size, tp_size=tp)
        )
        out[is_tied] = {"got": got, "expected": expected}
    return out


def parity(arch: str, model_dir: str, attention: str, temperature: float) -> dict:
    del arch  # the key of the result
    from transformers import AutoModelForCausalLM

    from yatt.core.policy._logits import compute_entropy, compute_token_logprobs
    from yatt.core.policy.megatron._config import layout_from_hf_config, padded_vocab_size
    from yatt.core.policy.megatron._model import build_gpt_model, load_hf_weights
    from yatt.core.policy.megatron._vocab_parallel import (
        compute_vocab_parallel_entropy,
        compute_vocab_parallel_logprobs,
    )
    from yatt.core.policy.megatron._weights import export_hf_weights

    tp = dist.get_world_size()
    tp_rank = _setup(tp)
    from megatron.core import parallel_state

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layout = layout_from_hf_config(hf.config)
    padded = padded_vocab_size(layout.vocab_size, tp_size=tp)
    model = build_gpt_model(
        layout, tp_size=tp, dtype=torch.float32, attention=attention, use_cpu_initialization=True
    )
    load_hf_weights(model, model_dir, layout, padded_vocab=padded, tp_rank=tp_rank, tp_size=tp)
    model.eval()

    # Two right-padded rows of different lengths.
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, layout.vocab_size, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    ids = ids * mask
    width = ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(width).expand_as(ids)
    logits = model(ids, positions, causal)
    vocab_start = tp_rank * (padded // tp)
    kwargs = {
        "vocab_start": vocab_start,
        "vocab_size": layout.vocab_size,
        "temperature": temperature,
    }
    logprobs = compute_vocab_parallel_logprobs(logits, ids, **kwargs)
    group = parallel_state.get_tensor_model_parallel_group()
    entropy = compute_vocab_parallel_entropy(logits, tp_group=group, **kwargs)
    with torch.no_grad():
        ref_logits = hf(input_ids=ids, attention_mask=mask).logits
    ref_logprobs = compute_token_logprobs(ref_logits, ids, temperature=temperature)
    ref_entropy = compute_entropy(ref_logits, temperature=temperature)

    # Backward through the vocab-parallel ops: d(sum logprobs + entropy)/d(logits), gathered,
    # against the same gradient of the HF formulation on the full logits.
    full_logits = ref_logits.clone().requires_grad_(True)
    ref_obj = (
        (
            compute_token_logprobs(full_logits, ids, temperature=temperature)
            + compute_entropy(full_logits, temperature=temperature)
        )
        * mask
    ).sum()
    ref_obj.backward()
    leaf = logits.detach().clone().requires_grad_(True)
    obj = (
        (
            compute_vocab_parallel_logprobs(leaf, ids, **kwargs)
            + compute_vocab_parallel_entropy(leaf, tp_group=group, **kwargs)
        )
        * mask
    ).sum()
    obj.backward()
    grads = [torch.empty_like(leaf.grad) for _ in range(tp)]
    dist.all_gather(grads, leaf.grad.contiguous(), group=group)
    grad = torch.cat(grads, dim=-1)

    exported = dict(
        export_hf_weights(
            model.named_parameters(), layout, bucket_bytes=4096, tp_group=group if tp > 1 else None
        )
    )
    hf_state = {k: v for k, v in hf.state_dict().items()}
    return {
        "mask": mask,
        "logprobs": logprobs.detach(),
        "ref_logprobs": ref_logprobs,
        "entropy": entropy.detach(),
        "ref_entropy": ref_entropy,
        "grad": grad[..., : layout.vocab_size],
        "grad_pad": grad[..., layout.vocab_size :],
        "ref_grad": full_logits.grad,
        "exported": exported,
        "hf_state": hf_state,
        "is_tied": layout.is_tied,
    }


def policy_vs_torch(model_dir: str) -> dict:
    """MegatronPolicy (float32, plain Megatron optimizer) and TorchPolicy: three train steps on
    the same batch; plus logprobs, named_weights and a state() round trip."""
    from yatt.core import Batch, PolicyLoss, TorchPolicy, TorchPolicyConfig, init_runtime
    from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig

    _cpu_shim.install_for_policy()
    import yatt.core.policy._head_logprobs as head_logprobs  # the chunking both backends use

    # Chunks of a few hundred logits: every micro-batch runs several (collectives in each).
    head_logprobs.CHUNK_ELEMENTS = 2048
    batch = _rl_batch()
    first_row = batch.select([0]).to_samples()[0]
    loss_fn = PolicyLoss(entropy_coef=0.01)
    common = {
        "model_dir": model_dir,
        "dtype": "float32",
        "lr": 1e-3,
        "grad_clip": None,
        "max_tokens_per_microbatch": 64,
    }
    with init_runtime(device="cpu", tp_size=dist.get_world_size()) as rt:
        policy = MegatronPolicy(
            MegatronPolicyConfig(**common, tp_size=rt.tp_size, use_distributed_optimizer=False), rt
        )
        logprobs = policy.logprobs(batch)
        batch.tokens["old_logprobs"] = logprobs
        batch.tokens["rollout_logprobs"] = rollout_logprobs_below(logprobs)
        # Logprobs and entropy in the output layer (the default) against the full logits.
        is_head = policy._is_head_logprobs
        by_path = {}
        with torch.no_grad():
            for path in (True, False):
                policy._is_head_logprobs = path
                by_path[path] = policy.forward_micro_batch(
                    batch.to(policy.device), needs_entropy=True, is_training=False
                )
        policy._is_head_logprobs = is_head
        steps = [policy.train_step(batch, loss_fn) for _ in range(3)]
        # No loss tokens anywhere (DAPO dropped every group): a skipped step, weights untouched
        # (the comparison with TorchPolicy's three steps below would catch a change).
        no_loss = {**first_row, "loss_mask": torch.zeros_like(first_row["loss_mask"])}
        skipped = policy.train_step(
            Batch.from_samples([no_loss], token_keys=("input_ids", "loss_mask")), loss_fn
        )
        weights = dict(policy.named_weights(bucket_bytes=2048))
        state = {k: v.state_dict() for k, v in policy.state().items()}
        saved = {k: {n: t.clone() for n, t in sd.items()} for k, sd in state.items()}
        policy.train_step(batch, loss_fn)
        for key, stateful in policy.state().items():
            stateful.load_state_dict(saved[key])
        restored = all(
            torch.equal(t, saved[k][n])
            for k, v in policy.state().items()
            for n, t in v.state_dict().items()
        )
        reference = TorchPolicy(
            TorchPolicyConfig(**common, parallel="none", attn_implementation="eager"), None
        )
        torch_steps = [reference.train_step(batch, loss_fn) for _ in range(3)]
        torch_weights = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
        cost_lengths = [5, 40, 300]
        costs = (policy.estimate_costs(cost_lengths), reference.estimate_costs(cost_lengths))
        batch_costs = (
            policy.estimate_batch_costs(batch),
            reference.estimate_costs(batch.lengths.tolist()),
        )
    return {
        "losses": [step["loss"] for step in steps],
        "step_metrics": steps[0],
        "batch_loss_tokens": float(batch["loss_mask"].sum()),
        "torch_step_metrics": torch_steps[0],
        "is_head_logprobs": is_head,
        "head_path": by_path[True],
        "plain_path": by_path[False],
        "skipped": skipped,
        "model_config": policy.model_config.to_dict(),
        "costs": costs,
        "batch_costs": batch_costs,
        "resident_bytes": policy.resident_bytes(),
        "param_bytes": sum(
            p.numel() * p.element_size() for c in policy.chunks for p in c.model.parameters()
        ),
        "torch_losses": [step["loss"] for step in torch_steps],
        "weights": weights,
        "torch_weights": torch_weights,
        "state_restored": restored,
        "num_state_tensors": sum(len(sd) for sd in saved.values()),
    }


def _rl_batch(num_rows: int = 6, low: int = 10, high: int = 40):
    """Rows of 10..40 tokens, the second half of each scored, advantages +-1."""
    from yatt.core import Batch

    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(num_rows):
        n = int(torch.randint(low, high, (1,), generator=gen))
        mask = torch.zeros(n, dtype=torch.int64)
        mask[n // 2 :] = 1
        ids = torch.randint(5, 260, (n,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "advantages": float(1 - 2 * (i % 2))})
    return Batch.from_samples(rows, token_keys=("input_ids", "loss_mask"))


def rollout_logprobs_below(logprobs: torch.Tensor) -> torch.Tensor:
    """The engine's logprobs below the trainer's by log 1.5, 0.1 or 0 (by position): the
    rollout weights exp(old - rollout) are 1.5, 1.105 or 1, all under the cap (2); every
    scored span (5+ tokens) has a 1.5, so "is_weight_max" is 1.5."""
    delta = torch.zeros_like(logprobs)
    delta[:, 0::3] = math.log(1.5)
    delta[:, 1::3] = 0.1
    return logprobs - delta


def _float32_config(model_dir: str, **sizes):
    """The MegatronPolicyConfig every layout scenario here runs: float32, no grad clip, small
    micro-batches, the plain optimizer (its state is what the checkpoint tests compare)."""
    from yatt.core.megatron import MegatronPolicyConfig

    return MegatronPolicyConfig(
        model_dir=model_dir,
        dtype="float32",
        lr=1e-3,
        grad_clip=None,
        max_tokens_per_microbatch=64,
        use_distributed_optimizer=False,
        **sizes,
    )


def _one_layout(model_dir: str, batch, **sizes) -> dict:
    """Logprobs, two train steps (gradients of the first before its update), the exported HF
    weights and the model state of MegatronPolicy at one parallel layout (float32)."""
    from megatron.core import parallel_state

    from yatt.core import PolicyLoss, init_runtime
    from yatt.core.megatron import MegatronPolicy
    from yatt.core.policy.megatron._weights import global_layer_name

    config = _float32_config(model_dir, **sizes)
    loss_fn = PolicyLoss(entropy_coef=0.01)
    with init_runtime(device="cpu", tp_size=config.model_parallel_size) as rt:
        policy = MegatronPolicy(config, rt)
        logprobs = policy.logprobs(batch)
        batch.tokens["old_logprobs"] = logprobs
        batch.tokens["rollout_logprobs"] = rollout_logprobs_below(logprobs)
        grads = {}
        real_step = policy.step_optimizer

        def step_and_record(lr):
            if not grads:
                for chunk in policy.chunks:
                    for name, param in chunk.model.named_parameters():
                        name = global_layer_name(name, chunk.layer_offset)
                        grads[name] = param.main_grad.detach().clone()
            real_step(lr)

        policy.step_optimizer = step_and_record
        metrics = [policy.train_step(batch, loss_fn) for _ in range(2)]
        del batch.tokens["old_logprobs"], batch.tokens["rollout_logprobs"]
        weights = {k: v.clone() for k, v in policy.named_weights(bucket_bytes=3000)}
        state = {k: v.state_dict() for k, v in policy.state().items()}
        out = {
            "logprobs": logprobs,
            "metrics": metrics,
            "grads": grads,
            "weights": weights,
            "model_state": {k: v.clone() for k, v in state["model"].items()},
            "optimizer_keys": sorted(state["optimizer"]),
            "pp_rank": policy.pp_rank,
            "num_micro_batches": metrics[0]["num_micro_batches"],
            "bins": policy.plan_micro_batches(batch),
            "lengths": batch.lengths.tolist(),
        }
        # The model state of the whole pipeline (every stage's keys) loads into this stage:
        # each stage takes its own layers by global name.
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out["model_state"])
        merged = {k: v for part in everyone for k, v in part.items()}
        policy.state()["model"].load_state_dict(merged)
        out["merged_model_keys"] = sorted(merged)
        # Another stage's optimizer state does not fit: a clear error, not a silent mix.
        opt_states = [None] * dist.get_world_size()
        dist.all_gather_object(opt_states, state["optimizer"])
        other = opt_states[(dist.get_rank() + 1) % dist.get_world_size()]
        try:
            policy.state()["optimizer"].load_state_dict(other)
            out["foreign_optimizer_error"] = None
        except ValueError as err:
            out["foreign_optimizer_error"] = str(err)
    parallel_state.destroy_model_parallel()
    return out


def _checkpoint_at(model_dir: str, pp_size: int, root: Path, *, load_from: Path | None) -> dict:
    """At pp_size: load `load_from` (saved at the other pp size) whole, then its model state
    alone; take one step; save under root/pp<pp_size>. Returns the error of the whole load,
    the weights after the model-alone load, and the weights saved."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state

    from yatt.core import PolicyLoss, init_runtime
    from yatt.core.megatron import MegatronPolicy

    config = _float32_config(model_dir, pp_size=pp_size)
    out: dict = {}
    with init_runtime(device="cpu", tp_size=config.model_parallel_size) as rt:
        policy = MegatronPolicy(config, rt)
        if load_from is not None:
            try:
                dcp.load(policy.state(), checkpoint_id=load_from)
                out["whole_load_error"] = None
            except dcp.CheckpointException as err:  # a BaseException naming the missing key
                out["whole_load_error"] = str(err)
            dcp.load({"model": policy.state()["model"]}, checkpoint_id=load_from)
            out["loaded_weights"] = {k: v.clone() for k, v in policy.named_weights()}
        batch = _rl_batch()
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
        policy.train_step(batch, PolicyLoss())
        dcp.save(policy.state(), checkpoint_id=root / f"pp{pp_size}")
        out["saved_weights"] = {k: v.clone() for k, v in policy.named_weights()}
    parallel_state.destroy_model_parallel()
    return out


def cross_pp_checkpoints(model_dir: str, root: Path) -> dict:
    """Saved at pp=2, loaded at pp=1; saved at pp=1, loaded at pp=2, with
    torch.distributed.checkpoint as yatt.ckpt uses it (yatt-core's tests cannot import
    yatt-ckpt: its nox session holds yatt-core and its own dependencies only)."""
    pp2 = _checkpoint_at(model_dir, 2, root, load_from=None)
    pp1 = _checkpoint_at(model_dir, 1, root, load_from=root / "pp2")
    back = _checkpoint_at(model_dir, 2, root, load_from=root / "pp1")
    return {"pp2": pp2, "pp1": pp1, "pp2_again": back}


def layouts(model_dir: str, cases: list) -> dict:
    """MegatronPolicy at each layout in `cases` ({"pp_size": 2, ...}), one after the other in
    this world; a layout with fewer model-parallel ranks than the world runs data parallel on
    the same batch (the same mean loss and gradient as one rank)."""
    _cpu_shim.install_for_policy()
    import yatt.core.policy._head_logprobs as head_logprobs

    head_logprobs.CHUNK_ELEMENTS = 2048
    batch = _rl_batch()
    out = {
        json.dumps(case, sort_keys=True): _one_layout(model_dir, batch, **case) for case in cases
    }
    # One directory for every rank (DCP writes each rank's shards beside the others').
    holder = [tempfile.mkdtemp(prefix="yatt-mg-pp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    out["checkpoints"] = cross_pp_checkpoints(model_dir, Path(holder[0]))
    dist.barrier()  # every rank done with the directory
    if dist.get_rank() == 0:
        shutil.rmtree(holder[0])
    return out


def recompute(model_dir: str, cases: list) -> dict:
    """MegatronPolicy (float32, one rank) per activation-recompute case ({} = off): logprobs,
    the first step's gradients, two steps' metrics, the weights after them, the recompute
    fields of the TransformerConfig the policy built, and how often megatron-core's
    tensor_parallel.checkpoint ran (the layers and submodules it recomputes in the backward)."""
    _cpu_shim.install_for_policy()
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core import parallel_state

    import yatt.core.policy._head_logprobs as head_logprobs
    from yatt.core import PolicyLoss, init_runtime
    from yatt.core.megatron import MegatronPolicy
    from yatt.core.policy.megatron._weights import global_layer_name

    head_logprobs.CHUNK_ELEMENTS = 2048
    real_checkpoint = tensor_parallel.checkpoint
    calls = [0]

    def counted_checkpoint(*args, **kwargs):
        calls[0] += 1
        return real_checkpoint(*args, **kwargs)

    tensor_parallel.checkpoint = counted_checkpoint
    batch = _rl_batch()
    out = {}
    for case in cases:
        config = _float32_config(model_dir, **case)
        with init_runtime(device="cpu", tp_size=config.model_parallel_size) as rt:
            policy = MegatronPolicy(config, rt)
            logprobs = policy.logprobs(batch)
            calls_in_logprobs = calls[0]
            batch.tokens["old_logprobs"] = logprobs
            grads = {}
            real_step = policy.step_optimizer

            def step_and_record(lr, policy=policy, grads=grads, real_step=real_step):
                if not grads:
                    for chunk in policy.chunks:
                        for name, param in chunk.model.named_parameters():
                            name = global_layer_name(name, chunk.layer_offset)
                            grads[name] = param.main_grad.detach().clone()
                real_step(lr)

            policy.step_optimizer = step_and_record
            metrics = [policy.train_step(batch, PolicyLoss(entropy_coef=0.01)) for _ in range(2)]
            del batch.tokens["old_logprobs"]
            tf_config = policy.chunks[0].model.config
            out[json.dumps(case, sort_keys=True)] = {
                "logprobs": logprobs,
                "metrics": metrics,
                "grads": grads,
                "weights": {k: v.clone() for k, v in policy.named_weights()},
                "tf_config": {
                    name: getattr(tf_config, name)
                    for name in (
                        "recompute_granularity",
                        "recompute_method",
                        "recompute_num_layers",
                        "recompute_modules",
                    )
                },
                "checkpoint_calls": calls[0],
                "checkpoint_calls_in_logprobs": calls_in_logprobs,
                "num_layers": policy.layout.num_layers,
            }
            calls[0] = 0
        parallel_state.destroy_model_parallel()
    return out


def sequential_runtimes(model_dir: str) -> dict:
    """Two runtimes one after the other in this process, each creating (and destroying) its
    world and building a MegatronPolicy: Megatron's model-parallel state must end with the
    first, or the second policy would reuse its destroyed groups."""
    from megatron.core import parallel_state

    from yatt.core import init_runtime
    from yatt.core.megatron import MegatronPolicy

    _cpu_shim.install_for_policy()
    batch = _rl_batch()
    out = {"logprobs": [], "is_initialized_after": []}
    for _ in range(2):
        with init_runtime(device="cpu") as rt:
            policy = MegatronPolicy(_float32_config(model_dir), rt)
            out["logprobs"].append(policy.logprobs(batch))
            del policy
        out["is_initialized_after"].append(parallel_state.model_parallel_is_initialized())
    return out


def run_all(model_dirs: dict, cases: list) -> dict:
    """Every case in one process (megatron-core takes ~20 s to import on a busy 2-core box)."""
    from megatron.core import parallel_state

    out = {"shapes": {arch: shapes(arch) for arch in model_dirs}}
    for attention, temperature in cases:
        for arch, path in model_dirs.items():
            out[(arch, attention, temperature)] = parity(arch, path, attention, temperature)
    assert parallel_state.model_parallel_is_initialized()
    out["policy"] = policy_vs_torch(model_dirs["qwen2"])
    return out


def main() -> None:
    scenario, out_dir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    if scenario == "sequential_runtimes":  # its runtimes create the world themselves
        result = sequential_runtimes(**kwargs)
        torch.save(result, out_dir / "rank0.pt")
        return
    dist.init_process_group("gloo")
    result = {"all": run_all, "layouts": layouts, "recompute": recompute}[scenario](**kwargs)
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    # Megatron's groups too, and the garbage holding them, so that few gloo threads outlive
    # this (one left to interpreter exit can abort a finished rank; see Runtime.shutdown).
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
