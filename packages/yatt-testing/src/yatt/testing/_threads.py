"""This process's native threads, for tests that check what a component leaves running."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_TASKS = Path("/proc/self/task")


def native_threads() -> dict[str, str] | None:
    """{thread id: name} of this process's native threads (Python's and C++'s alike: gloo's
    "pt_gloo_runloop", the TCP store's "pt_tcpstore_uv"); None where Linux's /proc is not
    there to list them."""
    if not _TASKS.is_dir():
        return None
    threads = {}
    for tid in os.listdir(_TASKS):
        with contextlib.suppress(OSError):  # a thread that ended while listed
            threads[tid] = (_TASKS / tid / "comm").read_text().strip()
    return threads
