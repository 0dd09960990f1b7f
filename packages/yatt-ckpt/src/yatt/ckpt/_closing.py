"""A run's resources closed in reverse, whatever happens: `ClosingStack`.

    with ClosingStack() as resources:
        ckpt = resources.close_later(Checkpointer(root))
        engine = resources.close_later(build_engine())
        ...                                   # the run

Each close() runs, last opened first, also after an error. A close() that fails is logged and
the rest still close; the run's own error is the one raised (a close error must never hide
it), and when the run ended well the first close error is raised instead.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any, TypeVar

logger = logging.getLogger("yatt.ckpt")

T = TypeVar("T")


class ClosingStack(contextlib.ExitStack):
    """contextlib.ExitStack whose registered close() errors are logged, never hide the run's own
    error, and are raised (the first) when the run itself ended well."""

    def __init__(self) -> None:
        super().__init__()
        self.close_errors: list[BaseException] = []

    def close_later(self, obj: T) -> T:
        """Call obj.close() when the stack ends (last registered first); returns obj."""
        self.callback(self._close, obj)
        return obj

    def _close(self, obj: Any) -> None:
        try:
            obj.close()
        except Exception as exc:  # keep closing the rest
            logger.exception("closing %s failed", type(obj).__name__)
            self.close_errors.append(exc)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        is_suppressed = super().__exit__(exc_type, exc, traceback)
        if exc_type is None and self.close_errors:
            raise self.close_errors[0]
        return is_suppressed
