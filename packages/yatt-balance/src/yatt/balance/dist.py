"""Deprecated: `yatt.balance.dist` is now `yatt.balance.across_ranks` (same names).

Kept for one release so `from yatt.balance.dist import rebalance` still works, with a
DeprecationWarning; it is removed in the next one.
"""

import warnings

from yatt.balance.across_ranks import *  # noqa: F403
from yatt.balance.across_ranks import __all__  # noqa: F401

warnings.warn(
    "yatt.balance.dist is renamed yatt.balance.across_ranks (the same names); import from "
    "there: `from yatt.balance.across_ranks import rebalance, restore`. The old name goes "
    "in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
