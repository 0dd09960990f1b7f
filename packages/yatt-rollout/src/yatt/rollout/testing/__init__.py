"""The conformance suite every rollout engine must pass (no pytest needed to import it)."""

from yatt.rollout.testing._conformance import (
    CONFORMANCE_CHECKS,
    ConformanceTarget,
    run_conformance,
)

__all__ = ["CONFORMANCE_CHECKS", "ConformanceTarget", "run_conformance"]
