"""Cross-rank rebalance of samples by cost (torch.distributed; gloo and NCCL).

The only public module that imports torch: `import yatt.balance` stays numpy-only.
"""

from yatt.balance.dist._plan import RebalancePlan, make_plan, partition_destination
from yatt.balance.dist._rebalance import rebalance, restore

__all__ = ["RebalancePlan", "make_plan", "partition_destination", "rebalance", "restore"]
