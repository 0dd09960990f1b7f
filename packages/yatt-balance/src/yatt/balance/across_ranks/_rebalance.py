"""Rebalance samples across data-parallel ranks by cost, and send results back.

every rank: lengths --all_gather--> all lengths --partition--> one plan (same everywhere)
every rank: rows --p2p, only what moves--> rows of its part (ascending global order)
... train, score ...
every rank: results --p2p, reverse--> results in the original ranks and order (restore)

Two levels. `rebalance_rows` / `restore_rows` move rows in the caller's own layout: the
caller's `take(indices)` builds one payload for all the rows bound to one peer (say a dict of
column tensors), and the returned `MovedRows` says which local rows stayed and where each
received payload's rows go, so the caller assembles its layout once. `rebalance` / `restore`
move a list of per-sample objects on top of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from yatt.balance._checks import as_nonnegative_array
from yatt.balance.across_ranks._exchange import exchange
from yatt.balance.across_ranks._plan import RebalancePlan, make_plan

# take(indices) -> the payload for those local rows (int64 indices, ascending).
Take = Callable[[np.ndarray], Any]


@dataclass(frozen=True, kw_only=True, eq=False)
class MovedRows:
    """Where each row a rank holds after `rebalance_rows` or `restore_rows` comes from.

    New row kept_at[j] is this rank's own row kept[j] (an index in the order before the move);
    new row received_at[peer][m] is row m of the payload `take` built on `peer`. The kept rows
    and each peer's rows keep their relative order, so every index array ascends.
    """

    num_rows: int  # rows this rank holds after the move
    kept: np.ndarray  # int64 [num_kept]: local rows that stay, indexed before the move
    kept_at: np.ndarray  # int64 [num_kept]: their positions after it
    received: dict[int, Any]  # peer -> the payload its take() built for the rows sent here
    received_at: dict[int, np.ndarray]  # peer -> int64 positions of those rows after the move


def rebalance(
    samples: Sequence[Any],
    lengths: Any,
    *,
    group: dist.ProcessGroup | None = None,
    groups: Any = None,
    costs: Any = None,
    equal_size: bool = False,
    tolerance: float = 1e-3,
) -> tuple[list[Any], RebalancePlan]:
    """Move samples between the ranks of `group` so every rank gets about the same cost.

    `lengths` holds each local sample's token count; it is the balancing cost unless `costs`
    (e.g. `flops_cost(lengths, ...)`) is given, and it weighs how much data a move costs, so
    each balanced part goes to the rank that already holds most of it. `groups` labels local
    samples that must stay together (a GRPO prompt's responses); labels are local to a rank.
    `equal_size` gives every rank the same number of samples (or groups). `tolerance` trades
    balance for locality: the plan starts from where samples are and moves as few (and as
    small) as it takes to bring every rank within (1 + tolerance) of the best balanced
    partition found, falling back to that partition when it cannot; 0 asks for the best
    balance whatever the movement (see make_plan for the exact rule). A sample is any
    picklable object; tensors inside dicts, lists and tuples move without pickling (on NCCL,
    GPU to GPU; call torch.cuda.set_device first). Collective: every rank of `group` calls it.
    Returns this rank's new samples and the plan that `restore` needs.
    """
    samples = list(samples)
    plan = _agree_on_plan(len(samples), lengths, group, groups, costs, equal_size, tolerance)
    moved = _move_rows(_take_from(samples), _rebalance_routes(plan), group)
    return _place(samples, moved), plan


def restore(
    results: Sequence[Any], plan: RebalancePlan, *, group: dist.ProcessGroup | None = None
) -> list[Any]:
    """Send each result (one per sample `rebalance` returned here, same order) back to the
    rank the sample came from; returns this rank's results in its original sample order.
    Collective over the same `group` as the rebalance that made `plan`."""
    results = list(results)
    routes = _restore_routes(plan, len(results), "results", group)
    return _place(results, _move_rows(_take_from(results), routes, group))


def rebalance_rows(
    take: Take,
    lengths: Any,
    *,
    group: dist.ProcessGroup | None = None,
    groups: Any = None,
    costs: Any = None,
    equal_size: bool = False,
    tolerance: float = 1e-3,
) -> tuple[MovedRows, RebalancePlan]:
    """`rebalance` for rows the caller keeps in its own layout (padded tensors, columns).

    One local row per entry of `lengths`; the plan is the one `rebalance` makes from the same
    arguments. `take(indices)` is called once for each peer this rank sends rows to, with
    those rows' local indices (int64, ascending), and returns their payload: tensors inside
    dicts, lists and tuples travel as raw bytes, anything else is pickled. Collective over
    `group`. Returns where every row this rank now holds comes from (its rows in ascending
    global order, as `rebalance` orders them) and the plan that `restore_rows` needs.
    """
    plan = _agree_on_plan(None, lengths, group, groups, costs, equal_size, tolerance)
    return _move_rows(take, _rebalance_routes(plan), group), plan


def restore_rows(
    take: Take, plan: RebalancePlan, *, num_rows: int, group: dist.ProcessGroup | None = None
) -> MovedRows:
    """`restore` for rows in the caller's own layout: this rank's `num_rows` rows (one per row
    `rebalance_rows` left here, same order) go back to the ranks they came from, through
    `take` as in `rebalance_rows`; the result places them in this rank's original order.
    Collective over the same `group` as the rebalance that made `plan`."""
    return _move_rows(take, _restore_routes(plan, num_rows, "rows", group), group)


def _agree_on_plan(
    num_rows: int | None,
    lengths: Any,
    group: dist.ProcessGroup | None,
    groups: Any,
    costs: Any,
    equal_size: bool,
    tolerance: float,
) -> RebalancePlan:
    world_size = dist.get_world_size(group)
    local, error = _validate(num_rows, lengths, groups, costs)
    if error is None:
        error = _validate_settings(tolerance)
    settings = (bool(equal_size), float(tolerance) if error is None else None)
    # Errors travel with the gathered data so every rank raises together instead of the
    # healthy ranks hanging in the next collective.
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (local, error, settings), group=group)
    errors = [f"rank {r}: {err}" for r, (_, err, _) in enumerate(gathered) if err]
    if errors:
        raise ValueError("rebalance got bad input on " + "; ".join(errors))
    # Each rank computes the plan itself, so differing settings would silently give
    # different plans (and a hang in the exchange): refuse them on every rank together.
    if len({g[2] for g in gathered}) > 1:
        seen = ", ".join(f"rank {r}: {g[2]}" for r, g in enumerate(gathered))
        raise ValueError(
            f"rebalance needs the same (equal_size, tolerance) on every rank; got {seen}"
        )
    return make_plan(
        rank=dist.get_rank(group),
        costs=[g[0]["costs"] for g in gathered],
        volumes=[g[0]["lengths"] for g in gathered],
        group_labels=[g[0]["groups"] for g in gathered],
        equal_size=equal_size,
        tolerance=float(tolerance),
    )


def _rebalance_routes(plan: RebalancePlan) -> tuple[int, np.ndarray, np.ndarray]:
    """(this rank, destination of each local row, origin of each row held after)."""
    rank = plan.rank
    offsets = plan.offsets
    held = plan.held_by(rank)
    return rank, plan.destination[offsets[rank] : offsets[rank + 1]], plan.origin_rank(held)


def _restore_routes(
    plan: RebalancePlan, num_rows: int, what: str, group: dist.ProcessGroup | None
) -> tuple[int, np.ndarray, np.ndarray]:
    """The rebalance's routes reversed, after checking `plan` fits this rank and its rows."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if (plan.world_size, plan.rank) != (world_size, rank):
        raise ValueError(
            f"plan was made for rank {plan.rank} of {plan.world_size}, but this is rank {rank} "
            f"of {world_size}: pass the group that rebalance used and this rank's own plan"
        )
    _, destination, origin = _rebalance_routes(plan)
    if num_rows != origin.shape[0]:
        raise ValueError(
            f"got {num_rows} {what} but this rank holds {origin.shape[0]} samples after "
            f"rebalance: pass exactly one of the {what} per rebalanced sample, in the same order"
        )
    return rank, origin, destination


def _move_rows(
    take: Take, routes: tuple[int, np.ndarray, np.ndarray], group: dist.ProcessGroup | None
) -> MovedRows:
    """Send each local row to routes' destination; row i after the move comes from routes'
    source[i]. Both keep the relative order of rows, so each peer's rows travel as one
    ascending run and land as one ascending run."""
    rank, destination, source = routes
    outgoing = {}
    for peer in np.unique(destination).tolist():
        if peer != rank:
            rows = np.flatnonzero(destination == peer)
            # The row count travels with the payload to catch ranks that disagree on the plan.
            outgoing[peer] = (rows.shape[0], take(rows))
    received_at = {
        peer: np.flatnonzero(source == peer) for peer in np.unique(source).tolist() if peer != rank
    }
    received = {}
    for peer, (count, payload) in exchange(outgoing, list(received_at), group).items():
        if count != received_at[peer].shape[0]:
            raise RuntimeError(
                f"rank {peer} sent {count} samples but the plan expects "
                f"{received_at[peer].shape[0]}: ranks called rebalance/restore with different "
                "arguments"
            )
        received[peer] = payload
    return MovedRows(
        num_rows=source.shape[0],
        kept=np.flatnonzero(destination == rank),
        kept_at=np.flatnonzero(source == rank),
        received=received,
        received_at=received_at,
    )


def _take_from(items: list[Any]) -> Take:
    return lambda rows: [items[i] for i in rows.tolist()]


def _place(items: list[Any], moved: MovedRows) -> list[Any]:
    out: list[Any] = [None] * moved.num_rows
    for i, at in zip(moved.kept.tolist(), moved.kept_at.tolist(), strict=True):
        out[at] = items[i]
    for peer, payload in moved.received.items():
        for at, item in zip(moved.received_at[peer].tolist(), payload, strict=True):
            out[at] = item
    return out


def _validate_settings(tolerance: Any) -> str | None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | np.number):
        return f"tolerance must be a number >= 0 (e.g. 1e-3); got {tolerance!r}"
    if not np.isfinite(tolerance) or tolerance < 0:
        return f"tolerance must be a finite number >= 0 (e.g. 1e-3, or 0 for the best balance); got {tolerance!r}"
    return None


def _validate(
    num_rows: int | None, lengths: Any, groups: Any, costs: Any
) -> tuple[dict[str, Any] | None, str | None]:
    """num_rows None: as many rows as lengths."""
    try:
        lens = as_nonnegative_array(lengths, "lengths")
        weights = lens if costs is None else as_nonnegative_array(costs, "costs")
        if num_rows is None:
            num_rows = lens.shape[0]
        for name, arr in (("lengths", lens), ("costs", weights)):
            if arr.shape[0] != num_rows:
                raise ValueError(f"{name} has {arr.shape[0]} entries for {num_rows} samples")
        labels = None
        if groups is not None:
            labels = np.asarray(groups)
            if labels.ndim != 1 or labels.shape[0] != num_rows:
                raise ValueError(
                    f"groups must hold one label per sample ({num_rows}); got shape {labels.shape}"
                )
    except ValueError as exc:
        return None, str(exc)
    return {"costs": weights, "lengths": lens, "groups": labels}, None
