"""Megatron-Core's pipeline schedule running yatt's micro-batches (MegatronPolicy at pp > 1).

With pipeline parallelism no rank runs a micro-batch end to end: Megatron's schedule
(`get_forward_backward_func`: 1F1B, or interleaved with virtual stages) calls our forward step
on every stage and our loss function on the last one, and runs the backward itself. So the
micro-batch loop of yatt.core.policy._train_step.run_train_step is replaced by one schedule call;
everything around it (the global unit count, the skip rules, the metrics) is the same:

    units = all_reduce over DP(loss units)                      as run_train_step
    schedule(micro-batches):  last stage: loss_sum = loss_fn(mb, logprobs, entropy)
                              backward of loss_sum * dp_cp / units       (the shared rule)
    metrics: summed on the last stage, broadcast over the pipeline, reduced over DP

Normalisation stays global: the loss function divides each micro-batch's loss *sum* by the
global unit count (times the ranks Megatron's DDP averages gradients over: dp x cp), exactly
as run_train_step does. Megatron's schedule would also divide every micro-batch's loss by the
micro-batch count (and multiply it by cp): `_FixedGrad` makes the backward ignore that, so the
gradient is the mean loss's over the global batch whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from yatt.core.data._batch import Batch
from yatt.core.policy._policy import LossFn, NeedsEntropy

# The skeleton's own end of a step and no-token warning, so both paths report alike.
from yatt.core.policy._train_step import (
    StepCounts,
    add_loss_metrics,
    finish_train_step,
    reduce_step_units,
    select_micro_batch,
    skip_empty_step,
)


class _FixedGrad(torch.autograd.Function):
    """Identity whose backward sends a gradient of exactly 1 to its input.

    The schedule scales the loss function's output in place (/ num_microbatches, x cp) before
    its backward; yatt's loss is already scaled by the global rule, so that factor is dropped.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(grad)


MicroBatch = tuple[Batch, bool]  # (micro-batch on the device, is a zero-loss dummy)


def run_schedule(
    policy: Any,
    micro_batches: list[MicroBatch],
    *,
    forward_only: bool,
    needs_entropy: bool,
    loss_of: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]],
) -> list[dict]:
    """Run Megatron's schedule over `micro_batches`; the loss function's dicts (last stage).

    loss_of(micro_batch, out_BTW) -> (scalar to backward, dict to collect); out_BTW holds
    logprob (and entropy) per position.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunk_of = {id(model): chunk for model, chunk in zip(policy.models, policy.chunks, strict=True)}

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        micro_batch = next(data_iterator)
        chunk = chunk_of[id(model)]
        out = policy.stage_forward(model, chunk, micro_batch[0], needs_entropy=needs_entropy)

        def loss_func(out_BTW: torch.Tensor):
            return loss_of(micro_batch, out_BTW)

        return out, loss_func

    rows, length = micro_batches[0][0]["input_ids"].shape
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step,
        # One iterator per model chunk: each virtual stage walks the micro-batches once.
        data_iterator=[iter(micro_batches) for _ in policy.models],
        model=policy.models,
        num_microbatches=len(micro_batches),
        # The activation shape [length, rows, hidden]: every micro-batch's with the interleaved
        # schedule (padded to it); ignored by 1F1B, whose stages exchange each shape.
        seq_length=length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def _pad_count(bins: list[list[int]], multiple: int) -> list[list[int]]:
    """Dummies up to a multiple of `multiple` (the interleaved schedule runs micro-batches in
    groups of pp; an incomplete group is refused by megatron-core)."""
    return bins + [[] for _ in range(-len(bins) % multiple)]


def plan_for_schedule(policy: Any, batch: Batch) -> tuple[list[MicroBatch], list[list[int]]]:
    """(micro-batches on the device, their sample indices).

    With virtual stages every micro-batch is padded to the step's largest rows x length (zero-
    loss rows, right-padding): megatron-core 0.16's interleaved schedule with
    variable_seq_lengths hung or paired a gradient with another micro-batch's shape on the
    CPU test (gloo, pp=2). Whether NCCL runs it with varying shapes is untested; the padding is
    correct either way, and costs compute on long-tailed batches. 1F1B needs no padding.
    """
    bins = policy.plan_micro_batches(batch)
    if not policy.config.virtual_pp_size:
        return [select_micro_batch(batch, index, policy.device) for index in bins], bins
    bins = _pad_count(bins, policy.config.pp_size)
    micro_batches = [select_micro_batch(batch, index, policy.device) for index in bins]
    rows = max(mb["input_ids"].shape[0] for mb, _ in micro_batches)
    length = max(mb["input_ids"].shape[1] for mb, _ in micro_batches)
    return [(pad_micro_batch(mb, rows, length), d) for mb, d in micro_batches], bins


def pad_micro_batch(mb: Batch, rows: int, length: int) -> Batch:
    """`mb` right-padded to `length` tokens and `rows` rows; a padding row is one attended
    token with zeros everywhere else (no loss), like the skeleton's dummy micro-batch."""
    have_rows, have_length = mb["input_ids"].shape[:2]
    tokens = {}
    for key, value in mb.tokens.items():
        padded = value.new_zeros((rows, length, *value.shape[2:]))
        padded[:have_rows, :have_length] = value
        tokens[key] = padded
    tokens["attention_mask"][have_rows:, 0] = 1
    samples = {}
    for key, value in mb.samples.items():
        padded = value.new_zeros((rows, *value.shape[1:]))
        padded[:have_rows] = value
        samples[key] = padded
    meta = {key: list(values) + [None] * (rows - have_rows) for key, values in mb.meta.items()}
    return Batch(tokens=tokens, samples=samples, meta=meta)


@torch.no_grad()
def pipeline_logprobs(policy: Any, batch: Batch) -> torch.Tensor:
    """compute_logprobs through the schedule: [B, T] float32 on every stage (the last stage's,
    broadcast over the pipeline)."""
    ids = batch["input_ids"]
    out_BT = torch.zeros(ids.shape, dtype=torch.float32, device=policy.device)
    micro_batches, bins = plan_for_schedule(policy, batch)

    def loss_of(micro_batch: MicroBatch, out_BTW: torch.Tensor):
        return out_BTW.new_zeros(()), {"logprobs": out_BTW[..., 0]}

    collected = run_schedule(
        policy, micro_batches, forward_only=True, needs_entropy=False, loss_of=loss_of
    )
    if policy.is_last_stage:
        for index, (mb, is_dummy), got in zip(bins, micro_batches, collected, strict=True):
            if not is_dummy:
                logprobs_BT = got["logprobs"][: len(index)]
                mask_BT = mb["attention_mask"][: len(index)].to(logprobs_BT.dtype)
                width = min(logprobs_BT.shape[1], ids.shape[1])
                out_BT[index, :width] = (logprobs_BT * mask_BT)[:, :width]
    if policy.config.pp_size > 1:
        dist.broadcast(out_BT, src=policy.pp_last_rank, group=policy.pp_group)
    return out_BT.to(ids.device)


def run_pipeline_train_step(
    policy: Any,
    batch: Batch,
    loss_fn: LossFn,
    *,
    counts: StepCounts,
    lr_at: Callable[[int], float],
    max_grad_norm: float | None,
) -> dict[str, float]:
    """run_train_step with the micro-batch loop run by Megatron's schedule (see the module
    docstring); the same metrics. Collective over the whole world."""
    lr = lr_at(counts.num_optimizer_steps)
    needs_entropy = isinstance(loss_fn, NeedsEntropy) and bool(loss_fn.needs_entropy)
    totals = reduce_step_units(loss_fn, batch, policy.dp_group)
    if totals["units"] == 0:
        return skip_empty_step(counts, lr)
    # The shared rule (run_train_step): the loss sum over the global units, times the ranks
    # Megatron's DDP averages gradients over (dp x cp: each CP rank's gradient holds its own
    # tokens' share).
    scale = policy.grad_average_size / totals["units"]
    policy.zero_grad()
    micro_batches, bins = plan_for_schedule(policy, batch)

    def loss_of(micro_batch: MicroBatch, out_BTW: torch.Tensor):
        mb, is_dummy = micro_batch
        entropy_BT = out_BTW[..., 1] if needs_entropy else None
        mb_loss, mb_metrics = loss_fn(mb, out_BTW[..., 0], entropy_BT)
        if is_dummy:
            mb_loss = mb_loss * 0.0  # keeps this pipeline's collectives, no gradient
        reported = {"loss": mb_loss.detach().to(torch.float64)}
        add_loss_metrics(reported, mb_metrics, is_dummy=is_dummy)
        return _FixedGrad.apply(mb_loss * scale), reported

    collected = run_schedule(
        policy, micro_batches, forward_only=False, needs_entropy=needs_entropy, loss_of=loss_of
    )
    sums = {}
    for reported in collected:  # empty except on the last stage
        add_loss_metrics(sums, reported, is_dummy=False)  # "..._max": the max, as in the loop
    sums = {key: float(value) for key, value in sums.items()}
    if policy.config.pp_size > 1:
        box = [sums]
        dist.broadcast_object_list(box, src=policy.pp_last_rank, group=policy.pp_group)
        sums = box[0]
    return finish_train_step(
        policy,
        sums,
        totals,
        group=policy.dp_group,
        counts=counts,
        max_grad_norm=max_grad_norm,
        lr=lr,
        num_micro_batches=len(bins),
    )
