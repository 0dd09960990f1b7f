"""Cross-rank rebalance of samples by cost (torch.distributed; gloo and NCCL).

The only public module that imports torch: `import yatt.balance` stays numpy-only.
"""

from yatt.balance._dist_plan import RebalancePlan
from yatt.balance._dist_rebalance import rebalance, restore

__all__ = ["RebalancePlan", "rebalance", "restore"]
