"""The train step and the logprobs pass that every policy backend runs (TorchPolicy, MegatronPolicy).

One train step, on every data-parallel rank (a backend supplies the hooks in `StepBackend`):

    units = all_reduce(loss units, loss tokens of this rank)    scalars only cross ranks
    no units on any rank: skip (DAPO dropped every group)       every rank skips together
    zero_grad
    for bin in plan_micro_batches(batch):                       same count on ranks that need it
        with grad_sync(is_last):                                grads reduced once, in the last
            logprobs, entropy = forward_micro_batch(mb)         (an empty bin: a dummy, loss * 0)
            loss_sum, metric_sums = loss_fn(mb, logprobs, entropy)
            (loss_sum * dp / units).backward()
    grad_norm, found_inf = reduce_and_clip_grads(max_norm)      global norm: a host sync
    loss = all_reduce(loss sums) / units
    step_optimizer(lr_at(step)) unless loss or norm not finite  then every rank skips together
    zero_grad

Dividing each micro-batch's loss sum by the global unit count (and multiplying by the dp size,
which DDP, FSDP2 and Megatron's DDP average away) makes the step's gradient equal to the
gradient of the mean loss over the concatenated global batch, whatever the split: the loss's
normalisation lives here, once, for every backend.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from yatt.core.data._batch import Batch
from yatt.core.policy._policy import LossFn, NeedsEntropy
from yatt.core.runtime._metrics import reduce_metrics
from yatt.core.runtime._repeated_log import RepeatedWarning

logger = logging.getLogger("yatt.core")
# A loss metric named "..._max" is a maximum over loss tokens (of non-negative values), reduced
# with max across micro-batches and ranks; every other loss metric is a sum over loss tokens.
MAX_METRIC_SUFFIX = "_max"
_NO_TOKENS = RepeatedWarning(logger, metric="is_skipped")


class StepBackend(Protocol):
    """The hooks a policy backend gives the shared train step and logprobs pass."""

    device: torch.device  # where micro-batches run
    dp_size: int  # data-parallel ranks (the loss scale undoes their gradient averaging)

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group (None: a single process)."""
        ...

    def plan_micro_batches(self, batch: Batch) -> list[list[int]]:
        """Sample indices per micro-batch; an empty list is a dummy micro-batch. Collective
        where ranks must run the same count (yatt.core.data._micro_batches.plan_micro_batches)."""
        ...

    def forward_micro_batch(
        self, mb: Batch, *, needs_entropy: bool, is_training: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, T] logprobs, [B, T] entropy or None) of the micro-batch, on the device."""
        ...

    def grad_sync(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        """Entered around each micro-batch's backward: reduce gradients in the last one only."""
        ...

    def zero_grad(self) -> None:
        """Clear the gradients (before the first micro-batch and after the optimizer step)."""
        ...

    def reduce_and_clip_grads(self, max_norm: float | None) -> tuple[float, bool]:
        """(global grad norm before clipping, found_inf) once every micro-batch has run; clips
        to `max_norm` unless None. A host sync: the skip decision needs the norm."""
        ...

    def step_optimizer(self, lr: float) -> None:
        """One optimizer step at learning rate `lr`."""
        ...


@dataclass(kw_only=True)
class StepCounts:
    """How many train steps a policy ran and how many updated the weights: the learning-rate
    schedule's position. Stateful (state_dict/load_state_dict), so a policy's state() carries it
    into a checkpoint and a resume continues the schedule where it stopped."""

    num_steps: int = 0  # train_step calls with loss units (a skipped update counts too)
    num_skipped_steps: int = 0  # non-finite loss or norm, or no loss units anywhere
    num_optimizer_steps: int = 0  # updates applied: the step the lr schedule is at

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Tensors, not ints: torch.distributed.checkpoint loads tensors in place.
        return {
            name: torch.tensor(getattr(self, name), dtype=torch.int64)
            for name in ("num_steps", "num_skipped_steps", "num_optimizer_steps")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("num_steps", "num_skipped_steps", "num_optimizer_steps"):
            setattr(self, name, int(state[name]))


def select_micro_batch(batch: Batch, index: list[int], device: torch.device) -> tuple[Batch, bool]:
    """(the micro-batch of `index` on `device`, whether it is a dummy: `index` is empty)."""
    if index:
        return batch.select(index).to(device, non_blocking=True), False
    return _dummy_like(batch).to(device), True


def _dummy_like(batch: Batch) -> Batch:
    """One sample of one token, zeros everywhere (so zero loss mask), shaped like `batch`."""
    tokens = {k: v.new_zeros((1, 1, *v.shape[2:])) for k, v in batch.tokens.items()}
    tokens["attention_mask"] = torch.ones_like(tokens["attention_mask"])
    samples = {k: v.new_zeros((1, *v.shape[1:])) for k, v in batch.samples.items()}
    meta = {k: [None] for k in batch.meta}
    return Batch(tokens=tokens, samples=samples, meta=meta)


@torch.no_grad()
def compute_logprobs(backend: StepBackend, batch: Batch) -> torch.Tensor:
    """[B, T] float32 logprobs of every input token (0 at t = 0 and on padding), on the batch's
    device, micro-batch by micro-batch. Collective where the backend's plan or forward is."""
    ids = batch["input_ids"]
    out_BT = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    for index in backend.plan_micro_batches(batch):
        mb, is_dummy = select_micro_batch(batch, index, backend.device)
        logprobs_BT, _ = backend.forward_micro_batch(mb, needs_entropy=False, is_training=False)
        if not is_dummy:
            mask_BT = mb["attention_mask"].to(logprobs_BT.dtype)
            out_BT[index, : logprobs_BT.shape[1]] = (logprobs_BT * mask_BT).to(out_BT.device)
    return out_BT


def _reduce_over(
    sums: dict[str, Any], group: Any, ops: dict[str, str] | None = None
) -> dict[str, float]:
    """reduce_metrics over `group` (default op "sum"); group None: this process alone, not
    the world (a runtime-less policy in a distributed job must not count other processes)."""
    if group is None:
        return {key: float(value) for key, value in sums.items()}
    return reduce_metrics(sums, group=group, ops=ops, default_op="sum")


def reduce_step_units(loss_fn: LossFn, batch: Batch, group: Any) -> dict[str, float]:
    """{"units": the loss's units, "tokens": loss tokens} summed over the data-parallel group
    (None: this process alone): what every micro-batch's loss sum is divided by (collective)."""
    local_tokens = float(batch["loss_mask"].sum()) if "loss_mask" in batch else 0.0
    return _reduce_over({"units": float(loss_fn.count_units(batch)), "tokens": local_tokens}, group)


def skip_empty_step(counts: StepCounts, lr: float) -> dict[str, float]:
    """A step whose global batch has no loss units: counted as skipped, nothing updated.
    Legit in DAPO: every group solved (zero reward variance) was dropped on every rank."""
    _NO_TOKENS.warn("train_step: the global batch has no response tokens; step skipped")
    counts.num_skipped_steps += 1
    return _step_metrics(
        {}, loss=0.0, grad_norm=0.0, lr=lr, num_micro_batches=0, num_tokens=0.0, is_skipped=True
    )


def add_loss_metrics(
    sums: dict[str, torch.Tensor], mb_metrics: dict[str, torch.Tensor], *, is_dummy: bool
) -> None:
    """Fold one micro-batch's loss metrics (as the loss returns them) into this rank's `sums`:
    added, or for a "..._max" metric the larger kept. A dummy micro-batch adds 0 but still
    adds its keys: every rank must report the same keys."""
    for key, value in mb_metrics.items():
        value = value.detach().to(torch.float64) * (0.0 if is_dummy else 1.0)
        if key.endswith(MAX_METRIC_SUFFIX):  # a max of non-negative values: 0 is neutral
            sums[key] = torch.maximum(sums.get(key, value), value)
        else:
            sums[key] = sums.get(key, 0.0) + value


def reduce_loss_metrics(
    sums: dict[str, torch.Tensor | float], totals: dict[str, float], *, group: Any
) -> tuple[float, dict[str, float]]:
    """(loss, loss metrics) of the step from every rank's `sums` ("loss": the loss summed over
    units, plus add_loss_metrics' sums): the loss over the global units; each metric over the
    global loss tokens, a "..._max" one the maximum over ranks. Collective over `group`
    (None: this process alone)."""
    max_keys = [key for key in sums if key.endswith(MAX_METRIC_SUFFIX)]
    reduced = _reduce_over(sums, group, ops=dict.fromkeys(max_keys, "max"))
    loss = reduced.pop("loss") / totals["units"]
    per_token = {
        key: value if key in max_keys else value / max(totals["tokens"], 1.0)
        for key, value in reduced.items()
    }
    return loss, per_token


def run_train_step(
    backend: StepBackend,
    batch: Batch,
    loss_fn: LossFn,
    *,
    counts: StepCounts,
    lr_at: Callable[[int], float],
    max_grad_norm: float | None,
) -> dict[str, float]:
    """One optimizer step over this rank's batch (see the module docstring); collective.

    lr_at: the learning rate of an optimizer step (yatt.core.policy._optimization.compute_lr), asked
    for counts.num_optimizer_steps. max_grad_norm: clip to it; None or 0: measure only.
    Returns globally reduced metrics: "loss" (mean over units), each loss metric averaged over
    loss tokens (a "..._max" one: its maximum), "grad_norm", "lr" (this step's),
    "num_micro_batches", "num_loss_tokens", "is_skipped". Updates `counts`.

    Several optimizer steps per rollout batch: call it once per mini-batch
    (yatt.core.split_mini_batches), with "old_logprobs" computed on the whole batch before the
    first; each call normalises over its own mini-batch's global units, as one step should.
    `merge_step_metrics` folds the calls' metrics into one dict.
    """
    lr = lr_at(counts.num_optimizer_steps)
    needs_entropy = isinstance(loss_fn, NeedsEntropy) and bool(loss_fn.needs_entropy)
    # One data-parallel rank (a runtime-less policy, too): nothing to reduce.
    group = backend.dp_group if backend.dp_size > 1 else None
    totals = reduce_step_units(loss_fn, batch, group)
    if totals["units"] == 0:
        return skip_empty_step(counts, lr)
    scale = backend.dp_size / totals["units"]
    backend.zero_grad()  # a failed step or a wake_up may have left gradients behind
    bins = backend.plan_micro_batches(batch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=backend.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for i, index in enumerate(bins):
        mb, is_dummy = select_micro_batch(batch, index, backend.device)
        with backend.grad_sync(is_last=i == len(bins) - 1):
            logprobs_BT, entropy_BT = backend.forward_micro_batch(
                mb, needs_entropy=needs_entropy, is_training=True
            )
            mb_loss, mb_metrics = loss_fn(mb, logprobs_BT, entropy_BT)
            if is_dummy:
                # Keeps this rank in the collectives without touching the gradient.
                mb_loss = mb_loss * 0.0
            (mb_loss * scale).backward()
        loss_sum += mb_loss.detach().to(torch.float64)
        add_loss_metrics(metric_sums, mb_metrics, is_dummy=is_dummy)
    return finish_train_step(
        backend,
        {"loss": loss_sum, **metric_sums},
        totals,
        group=group,
        counts=counts,
        max_grad_norm=max_grad_norm,
        lr=lr,
        num_micro_batches=len(bins),
    )


def finish_train_step(
    backend: Any,
    sums: dict[str, Any],
    totals: dict[str, float],
    *,
    group: Any,
    counts: StepCounts,
    max_grad_norm: float | None,
    lr: float,
    num_micro_batches: int,
) -> dict[str, float]:
    """Every backend's end of a train step once its micro-batches ran: the global norm (clipped),
    the loss metrics reduced over `group`, the optimizer step, or a skip when the loss or the
    norm is not finite; the step's metrics. `backend` has StepBackend's reduce_and_clip_grads,
    step_optimizer and zero_grad."""
    grad_norm, found_inf = backend.reduce_and_clip_grads(max_grad_norm or None)
    loss, per_token = reduce_loss_metrics(sums, totals, group=group)
    is_finite = math.isfinite(loss) and math.isfinite(grad_norm) and not found_inf
    if is_finite:
        backend.step_optimizer(lr)
        counts.num_optimizer_steps += 1
    else:
        # Every rank sees the same global loss and norm, so every rank skips together.
        counts.num_skipped_steps += 1
        logger.warning(
            "train_step: skipped the optimizer step (loss=%s, grad_norm=%s)", loss, grad_norm
        )
    backend.zero_grad()
    counts.num_steps += 1
    return _step_metrics(
        per_token,
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        num_micro_batches=num_micro_batches,
        num_tokens=totals["tokens"],
        is_skipped=not is_finite,
    )


def _step_metrics(
    loss_metrics: dict[str, float],
    *,
    loss: float,
    grad_norm: float,
    lr: float,
    num_micro_batches: int,
    num_tokens: float,
    is_skipped: bool,
) -> dict[str, float]:
    """The step's metrics dict, the same keys from every backend and every outcome."""
    return {
        **loss_metrics,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(lr),
        "num_micro_batches": float(num_micro_batches),
        "num_loss_tokens": num_tokens,
        "is_skipped": float(is_skipped),
    }


# Metrics of run_train_step that are not token averages of loss metrics.
_STEP_KEYS = ("loss", "grad_norm", "lr", "num_micro_batches", "num_loss_tokens", "is_skipped")


def merge_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict for several train steps over one rollout batch (mini-batches, epochs).

    Loss metrics and "loss": means weighted by each step's loss tokens ("..._max": the max);
    "grad_norm": the mean over steps with loss tokens; "lr": the last step's;
    "num_micro_batches", "num_loss_tokens": sums; "is_skipped": 1 only if no step updated the
    weights; "num_optimizer_steps": the steps that did. Every rank passes the same values
    (each step's metrics are global), so the merge needs no collective.
    """
    if not steps:
        raise ValueError("merge_step_metrics needs at least one step's metrics")
    tokens = [step["num_loss_tokens"] for step in steps]
    total_tokens = sum(tokens)
    merged: dict[str, float] = {}
    # A step skipped for want of loss tokens reports no loss metrics (and has no tokens).
    loss_keys = dict.fromkeys(key for step in steps for key in step if key not in _STEP_KEYS)
    for key in loss_keys:
        values = [step.get(key, 0.0) for step in steps]
        if key.endswith(MAX_METRIC_SUFFIX):
            merged[key] = max(values)
        else:
            weighted = sum(v * n for v, n in zip(values, tokens, strict=True))
            merged[key] = weighted / total_tokens if total_tokens else 0.0
    weighted_loss = sum(step["loss"] * n for step, n in zip(steps, tokens, strict=True))
    norms = [step["grad_norm"] for step, n in zip(steps, tokens, strict=True) if n]
    num_updates = sum(1 for step in steps if not step["is_skipped"])
    merged |= {
        "loss": weighted_loss / total_tokens if total_tokens else 0.0,
        "grad_norm": sum(norms) / len(norms) if norms else 0.0,
        "lr": steps[-1]["lr"],
        "num_micro_batches": float(sum(step["num_micro_batches"] for step in steps)),
        "num_loss_tokens": float(total_tokens),
        "is_skipped": float(num_updates == 0),
        "num_optimizer_steps": float(num_updates),
    }
    return merged
