"""A fake engine whose response times the test controls, and a JSONL prompt set, for the
off-policy driver tests (threads here; real processes in _offpolicy_resume_worker.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from yatt.core import ROW_INDEX_KEY


def write_prompts(path: Path, num_rows: int, slow_rows=(), num_tokens: int = 4) -> Path:
    with path.open("w") as f:
        for i in range(num_rows):
            row = {"prompt": f"p{i}", "num_tokens": num_tokens, "is_slow": i in set(slow_rows)}
            f.write(json.dumps(row) + "\n")
    return path


class FakeEngine:
    """generate(row, version): one token per step, each stamped with the engine's version as
    it is emitted. A slow row emits its first token, then waits for `slow_gate` (set by the
    test) or sleeps `slow_s` seconds: the tail the test controls."""

    def __init__(self, *, slow_s: float | None = None, name: str = "engine") -> None:
        self.name = name  # in every result: which engine generated a group
        self.slow_gate = threading.Event()
        self.slow_s = slow_s
        self.num_calls = 0
        self.rows_seen: list[int] = []
        self.slow_rows_started: list[int] = []  # slow rows whose first token is out
        self._lock = threading.Lock()

    def generate(self, row, version):
        with self._lock:
            self.num_calls += 1
            self.rows_seen.append(row[ROW_INDEX_KEY])
        versions = []
        for i in range(row["num_tokens"]):
            if row["is_slow"] and i == 1:
                with self._lock:
                    self.slow_rows_started.append(row[ROW_INDEX_KEY])
                if self.slow_s is None:
                    assert self.slow_gate.wait(timeout=60), "the test never released the tail"
                else:
                    time.sleep(self.slow_s)
            versions.append(version())
        return {"row_index": row[ROW_INDEX_KEY], "versions": versions, "engine": self.name}
