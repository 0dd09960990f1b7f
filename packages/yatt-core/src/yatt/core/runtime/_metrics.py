"""Reduce a dict of scalar statistics across ranks in one collective.

Each rank contributes one float64 vector (its values, in sorted key order, plus a fingerprint of
the key set); one all_gather brings every rank's vector to every rank, which then computes the
sum, mean, min or max per key locally. One collective instead of one per key or per operation.
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

    ops picks the reduction per key (default `default_op`). Every rank must pass the same keys;
    a rank with nothing to report for a key should pass 0 and use "sum".
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
    local = torch.tensor([*values, _fingerprint(keys)], dtype=torch.float64, device=device)
    world_size = dist.get_world_size(group)
    # Flat output: gloo accepts only the concatenated form. all_gather_single is the newer
    # name (torch >= 2.13) of all_gather_into_tensor.
    flat = torch.empty(world_size * local.numel(), dtype=torch.float64, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(flat, local, group=group)
    # Host sync: the caller wants Python floats, so the result comes back to the CPU.
    gathered = flat.view(world_size, -1).cpu()
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
