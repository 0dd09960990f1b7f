"""The commit a benchmark measured, for its results file.

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
    from measured_commit import measured_commit

$YATT_COMMIT wins when set: the device machine gets the working tree, but its `.git` can hold an
older HEAD (session 15 recorded a stale one), so GPU runs pass the real commit in. Otherwise
`git rev-parse --short HEAD` in the repository, with "+dirty" when any of `watched` (paths
relative to the root) differ from it; "unknown" without git.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measured_commit(watched: Sequence[str] = (), root: Path = ROOT) -> str:
    if os.environ.get("YATT_COMMIT"):
        return os.environ["YATT_COMMIT"]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown"
    dirty = bool(watched) and bool(git("status", "--porcelain", "--", *watched))
    return sha + ("+dirty" if dirty else "")
