"""The deprecated name yatt.balance.dist: same objects as yatt.balance.across_ranks, and a
DeprecationWarning naming the new module."""

NUM_GPUS = 0

import importlib
import sys

import pytest


def test_old_name_warns_and_gives_the_same_objects():
    import yatt.balance.across_ranks as across_ranks

    sys.modules.pop("yatt.balance.dist", None)  # the warning fires on first import only
    with pytest.warns(DeprecationWarning, match=r"yatt\.balance\.across_ranks"):
        old = importlib.import_module("yatt.balance.dist")
    for name in ("rebalance", "restore", "rebalance_rows", "restore_rows", "make_plan"):
        assert getattr(old, name) is getattr(across_ranks, name)
    assert sorted(old.__all__) == sorted(across_ranks.__all__)
