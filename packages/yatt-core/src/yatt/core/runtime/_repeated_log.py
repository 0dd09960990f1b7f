"""A warning that can fire every step, logged so that a person can still read the log.

The numbers behind such a warning are metrics every step (dynamic_sampling/is_filled,
train/is_skipped); the log says once what they mean, then how often it kept happening.
"""

from __future__ import annotations

import logging


class RepeatedWarning:
    """Log the first occurrence, then one line per `every` occurrences with the count."""

    def __init__(self, logger: logging.Logger, *, metric: str, every: int = 50) -> None:
        if every < 1:
            raise ValueError(f"every={every!r}: must be >= 1")
        self.logger = logger
        self.metric = metric
        self.every = every
        self.count = 0

    def warn(self, message: str, *args: object) -> bool:
        """Count one occurrence; returns whether it was logged."""
        self.count += 1
        if self.count != 1 and self.count % self.every:
            return False
        self.logger.warning(
            message + " (%d times so far, in the metric %s; logged again after %d more)",
            *args,
            self.count,
            self.metric,
            self.every,
        )
        return True
