"""Reduce a dict of scalar statistics across ranks in one collective.

Each rank contributes one float64 vector (its values, in sorted key order, plus a fingerprint of
the key set); one all_gather brings every rank's vector to every rank, which then computes the
sum, mean, min or max per key locally. One collective instead of one per key or per operation,
after a two-number header (key count and fingerprint) that lets ranks whose key sets differ (a
count by cause that only one rank saw) agree on their union before the vectors are gathered:
gloo aborts the process on a gather of unequal lengths.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist

ReduceOp = Literal["mean", "sum", "min", "max"]
REDUCE_OPS: tuple[str, ...] = ("mean", "sum", "min", "max")


def _fingerprint(keys: list[str]) -> float:
    # crc32 fits a float64 exactly; a mismatch means ranks logged different metric names,
    # which would silently pair one rank's "loss" with another's "kl".
    return float(zlib.crc32("\0".join(keys).encode()))


def reduce_metrics(
    metrics: Mapping[str, float | int | torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    ops: Mapping[str, ReduceOp] | None = None,
    default_op: ReduceOp = "mean",
) -> dict[str, float]:
    """{key: reduced value} over the ranks of `group` (default: the world); collective.

    ops picks the reduction per key (default `default_op`). Ranks may pass different keys when
    each key a rank lacks is reduced by "sum", "min" or "max" (its identity, 0, +inf or -inf,
    stands in: a count by cause one rank never saw); a "mean" key missing on a rank, or a key
    whose op differs between ranks, is a ValueError on every rank.
    """
    ops = dict(ops or {})
    for key, op in [*ops.items(), ("default_op", default_op)]:
        if op not in REDUCE_OPS:
            raise ValueError(f"ops[{key!r}]={op!r} is not a reduction; use one of {REDUCE_OPS}")
    unknown = sorted(set(ops) - set(metrics))
    if unknown:
        raise ValueError(f"ops names keys {unknown} that are not in metrics")
    keys = sorted(metrics)
    values = [
        float(metrics[k].item() if isinstance(metrics[k], torch.Tensor) else metrics[k])
        for k in keys
    ]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(zip(keys, values, strict=True))
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    world_size = dist.get_world_size(group)
    header = torch.tensor([len(keys), _fingerprint(keys)], dtype=torch.float64, device=device)
    headers = _all_gather_flat(header, world_size, group)
    if not torch.all(headers == header.cpu()):
        keys, values, ops = _union(keys, values, ops, default_op, group, world_size)
    local = torch.tensor([*values, _fingerprint(keys)], dtype=torch.float64, device=device)
    gathered = _all_gather_flat(local, world_size, group)
    if not torch.all(gathered[:, -1] == local[-1].cpu()):
        raise ValueError(f"reduce_metrics: ranks passed different metric keys (this rank: {keys})")
    out: dict[str, float] = {}
    for j, key in enumerate(keys):
        column = gathered[:, j]
        op = ops.get(key, default_op)
        if op == "mean":
            out[key] = float(column.mean())
        elif op == "sum":
            out[key] = float(column.sum())
        elif op == "min":
            out[key] = float(column.min())
        else:
            out[key] = float(column.max())
    return out


def _all_gather_flat(local: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """(world_size, len(local)) on the CPU: every rank's `local`."""
    # Flat output: gloo accepts only the concatenated form. all_gather_single is the newer
    # name (torch >= 2.13) of all_gather_into_tensor.
    flat = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(flat, local, group=group)
    # Host sync: the caller wants Python floats, so the result comes back to the CPU.
    return flat.view(world_size, -1).cpu()


_IDENTITY = {"sum": 0.0, "min": float("inf"), "max": float("-inf")}


def _union(
    keys: list[str],
    values: list[float],
    ops: Mapping[str, ReduceOp],
    default_op: ReduceOp,
    group,
    world_size: int,
) -> tuple[list[str], list[float], dict[str, ReduceOp]]:
    """The union of every rank's keys, this rank's missing ones filled with their op's identity,
    and every key's op.
    Every rank decides from the same gathered (keys, ops), so all of them return or all raise."""
    mine = {key: ops.get(key, default_op) for key in keys}
    everyone: list[dict[str, str] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    union: dict[str, str] = {}
    for rank, theirs in enumerate(everyone):
        for key, op in theirs.items():
            if union.setdefault(key, op) != op:
                raise ValueError(
                    f"reduce_metrics: {key!r} is reduced by {union[key]!r} on one rank and by "
                    f"{op!r} on rank {rank}"
                )
    for key, op in sorted(union.items()):
        missing = [rank for rank, theirs in enumerate(everyone) if key not in theirs]
        if missing and op not in _IDENTITY:
            raise ValueError(
                f"reduce_metrics: ranks {missing} did not pass {key!r} (op {op!r}); a key some "
                'ranks lack must be reduced by "sum", "min" or "max"'
            )
    have = dict(zip(keys, values, strict=True))
    union_keys = sorted(union)
    union_values = [have.get(key, _IDENTITY.get(union[key], 0.0)) for key in union_keys]
    return union_keys, union_values, union
