"""Balance sequences across data-parallel ranks and micro-batches by estimated compute.

numpy only; `yatt.balance.across_ranks` (rebalance/restore across ranks) needs torch.
"""

from yatt.balance._cost import cost, flops_cost
from yatt.balance._pack import pack
from yatt.balance._partition import imbalance, partition
from yatt.balance._version import __version__

__all__ = ["__version__", "cost", "flops_cost", "imbalance", "pack", "partition"]
