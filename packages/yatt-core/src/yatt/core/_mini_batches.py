"""Mini-batches: one optimizer step each, several per rollout batch (so PPO's clip can act).

    batch (this rank's, already balanced across ranks by Batch.rebalance)
      -> split_mini_batches(batch, n, costs=policy.estimate_costs(lengths))
      -> n batches of near-equal cost, GRPO groups kept whole; each goes to one train_step

Not to be confused with micro-batches (yatt.core._micro_batches): those split one optimizer
step's forward/backward to fit memory; a mini-batch is a whole optimizer step. Every rank
splits into the same n (a config constant), so the ranks' train_step calls pair up; a rank
short of groups (DAPO filtering) gets empty mini-batches, which train_step runs as dummies.
"""

from __future__ import annotations

from collections.abc import Sequence

from yatt.balance import partition
from yatt.core._batch import Batch


def split_mini_batches(
    batch: Batch,
    num_mini_batches: int,
    *,
    costs: Sequence[float] | None = None,
    group_key: str | None = "group_id",
) -> list[Batch]:
    """`num_mini_batches` batches of this rank's samples, cost sums as equal as
    yatt.balance.partition makes them, each sample in exactly one.

    costs: one per sample (the policy's estimate_costs, as for Batch.rebalance); None: lengths.
    group_key: a sample field whose equal values stay in one mini-batch (the GRPO group, so a
    mini-batch holds whole groups, as verl and TRL split); None: split freely.
    Mini-batches come in order of their first sample; empty ones (fewer groups than
    mini-batches) come last.
    """
    if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int):
        raise ValueError(f"num_mini_batches={num_mini_batches!r}: must be an int >= 1")
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches={num_mini_batches!r}: must be an int >= 1")
    if num_mini_batches == 1:
        return [batch]
    if costs is None:
        costs = batch.lengths.tolist()
    if len(costs) != len(batch):
        raise ValueError(f"costs has {len(costs)} entries for a batch of {len(batch)} samples")
    groups = None
    if group_key is not None:
        if group_key not in batch:
            raise ValueError(
                f"group_key={group_key!r} is not a field of the batch; pass the GRPO group's "
                "field name, or group_key=None to split samples freely"
            )
        groups = batch[group_key].tolist()
    parts = partition(list(costs), num_mini_batches, groups=groups)
    parts = sorted(parts, key=lambda part: (not part, part[0] if part else 0))
    return [batch.select(part) for part in parts]
