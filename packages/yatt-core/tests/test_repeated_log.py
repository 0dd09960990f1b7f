"""A warning that fires every step is logged once, then once per `every` occurrences."""

import logging

import pytest

from yatt.core.runtime._repeated_log import RepeatedWarning

NUM_GPUS = 0


def test_first_then_every_nth_occurrence_is_logged_with_the_count(caplog):
    warning = RepeatedWarning(logging.getLogger("yatt.test"), metric="x/y", every=3)
    with caplog.at_level(logging.WARNING, logger="yatt.test"):
        logged = [warning.warn("step %d: nothing to do", step) for step in range(7)]
    assert logged == [True, False, True, False, False, True, False]
    lines = [record.getMessage() for record in caplog.records]
    assert (
        lines[0]
        == "step 0: nothing to do (1 times so far, in the metric x/y; logged again after 3 more)"
    )
    assert lines[-1].startswith("step 5: nothing to do (6 times so far")


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every=0"):
        RepeatedWarning(logging.getLogger("yatt.test"), metric="m", every=0)
