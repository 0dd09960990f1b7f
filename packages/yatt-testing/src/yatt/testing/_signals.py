"""Stop a running command with a signal once it has reached a given point: the launch, wait,
signal and clean-up every stop-signal test repeats.

    run = signal_when_ready(command, signal.SIGTERM, ready=lambda: marker.exists(),
                            what="a verdict", env=env)
    run.returncode, run.stderr, run.stopped_s    # 128 + 15, its stderr, signal -> exit
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

_POLL_S = 0.1


@dataclasses.dataclass(frozen=True)
class SignalledRun:
    returncode: int
    stderr: str
    stopped_s: float  # from the signal to the process's exit


def signal_when_ready(
    command: Sequence[str],
    signum: int,
    *,
    ready: Callable[[], bool],
    what: str = "the ready point",
    env: Mapping[str, str] | None = None,
    while_ready: Callable[[subprocess.Popen[str]], None] | None = None,
    ready_timeout_s: float = 300.0,
    exit_timeout_s: float = 300.0,
) -> SignalledRun:
    """Start `command` (stderr captured as text), poll `ready()` until it is true, run
    `while_ready(process)` (checks made while it runs), send `signum` and wait for the exit.

    AssertionError naming `what` when the process ends or `ready_timeout_s` passes before
    `ready()`; the process is killed whenever this returns or raises with it still running."""
    process = subprocess.Popen(
        list(command), env=None if env is None else dict(env), stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not ready():
            if process.poll() is not None or time.monotonic() > deadline:
                _, stderr = process.communicate(timeout=exit_timeout_s)
                raise AssertionError(
                    f"{what} never came (rc {process.returncode}):\n{stderr[-3000:]}"
                )
            time.sleep(_POLL_S)
        if while_ready is not None:
            while_ready(process)
        process.send_signal(signum)
        begin = time.monotonic()
        _, stderr = process.communicate(timeout=exit_timeout_s)
        stopped_s = time.monotonic() - begin
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return SignalledRun(returncode=process.returncode, stderr=stderr, stopped_s=stopped_s)
