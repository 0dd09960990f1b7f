"""Cross-rank rebalance of samples by cost (torch.distributed; gloo and NCCL).

The only public module that imports torch: `import yatt.balance` stays numpy-only.
`rebalance` / `restore` move a list of samples; `rebalance_rows` / `restore_rows` move rows
that the caller keeps in its own layout (e.g. padded tensors), so it assembles them once.
"""

from yatt.balance.across_ranks._plan import RebalancePlan, make_plan, partition_destination
from yatt.balance.across_ranks._rebalance import (
    MovedRows,
    rebalance,
    rebalance_rows,
    restore,
    restore_rows,
)

__all__ = [
    "MovedRows",
    "RebalancePlan",
    "make_plan",
    "partition_destination",
    "rebalance",
    "rebalance_rows",
    "restore",
    "restore_rows",
]
