"""signal_when_ready: a real child process, signalled once it reached its ready point; one that
never gets there fails with its stderr and is not left running."""

NUM_GPUS = 0

import signal
import sys

import pytest

from yatt.testing import signal_when_ready

# Touches its marker, then exits 128 + signum on SIGTERM (as the trainer does), after a line
# on stderr.
_CHILD = """
import signal, sys, time
from pathlib import Path
def stop(signum, frame):
    print("stopped by signal", signum, file=sys.stderr)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1]).touch()
time.sleep(60)
"""


def test_the_signal_comes_after_the_ready_point_and_the_exit_is_reported(tmp_path):
    marker = tmp_path / "ready"
    seen = []
    run = signal_when_ready(
        [sys.executable, "-c", _CHILD, str(marker)],
        signal.SIGTERM,
        ready=marker.exists,
        while_ready=lambda process: seen.append(process.poll()),
        ready_timeout_s=60,
        exit_timeout_s=60,
    )
    assert seen == [None]  # while_ready ran with the process alive
    assert run.returncode == 128 + signal.SIGTERM
    assert "stopped by signal 15" in run.stderr
    assert 0 <= run.stopped_s < 30


def test_a_process_that_ends_before_it_is_ready_fails_naming_what(tmp_path):
    command = [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(AssertionError, match=r"(?s)a verdict never came \(rc 3\).*boom"):
        signal_when_ready(
            command, signal.SIGTERM, ready=lambda: False, what="a verdict", ready_timeout_s=60
        )
