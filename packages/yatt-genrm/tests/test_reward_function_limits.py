"""Reward functions that hang, crash, exit or overflow: the run goes on, or stops when asked."""

NUM_GPUS = 0

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from yatt.genrm import CombinedRM, RewardFunction, Sample, ScoreStats, load_reward_function

pytestmark = pytest.mark.timeout(60)

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max

REWARDS_PY = """
import os
import sys
import time


def score(prompt, response, reference, row):
    mode = row.get("mode", "")
    if mode == "hang":
        if row.get("pid_file"):
            with open(row["pid_file"], "w") as f:
                f.write(str(os.getpid()))
        while True:
            time.sleep(0.01)
    if mode == "crash":
        os._exit(3)
    if mode == "exit":
        sys.exit(0)
    if mode == "print":
        print("a reward function that prints", flush=True)
        os.write(1, b"raw bytes to fd 1")
    if mode == "huge":
        return 1e39
    if mode == "-huge":
        return -1e39
    if mode == "image":
        red, green, blue = row["image"].convert("RGB").getpixel((0, 0))
        return float(red > 128 and blue < 128)
    if mode == "str":
        return "0.5"
    if mode == "raise":
        return 1 / 0
    if mode == "none":
        return None
    return float(response == reference)


def worker_pid(prompt, response, reference, row):
    return float(os.getpid())
"""


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "limit_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _sample(response: str = "4", mode: str = "", **row) -> Sample:
    return Sample(prompt="2+2?", response=response, reference="4", metadata={"mode": mode, **row})


def test_a_hung_call_times_out_and_the_next_sample_is_scored(rewards_file) -> None:
    fn = load_reward_function(
        f"{rewards_file}:score", timeout_s=0.5, default_reward=-1.0, num_threads=1
    )
    try:
        begin = time.monotonic()
        verdicts = fn.score([_sample("4"), _sample("4", "hang"), _sample("4"), _sample("5")])
        elapsed = time.monotonic() - begin
        assert [v.status for v in verdicts] == ["ok", "error", "ok", "ok"]
        assert [v.reward for v in verdicts] == [1.0, -1.0, 1.0, 0.0]
        assert verdicts[1].error == (
            "limit_rewards:score took over timeout_s=0.5 s; its worker process group was "
            "killed (the next call starts a new one)"
        )
        assert fn.metrics["num_timeouts"] == 1 and fn.metrics["num_errors"] == 1
        assert elapsed < 15  # one 0.5 s wait and two worker starts, not a hang
        assert ScoreStats.from_verdicts(verdicts).num_errors == 1
        # The next call reuses the replacement worker: one start per kill, not per call.
        num_starts = fn.pool_stats()["num_worker_starts"]
        assert [v.reward for v in fn.score([_sample("4"), _sample("5")])] == [1.0, 0.0]
        assert fn.pool_stats()["num_worker_starts"] == num_starts == 2
    finally:
        fn.close()


def test_a_worker_that_died_while_idle_is_replaced_at_no_sample_s_cost(rewards_file) -> None:
    fn = load_reward_function(f"{rewards_file}:worker_pid", timeout_s=20.0, num_threads=1)
    try:
        (first,) = fn.score([_sample()])
        os.kill(int(first.reward), signal.SIGKILL)  # e.g. the OOM killer, between steps
        time.sleep(0.2)
        (second,) = fn.score([_sample()])
    finally:
        fn.close()
    assert second.status == "ok" and second.reward != first.reward
    assert fn.pool_stats()["num_worker_starts"] == 2


def test_worker_failures_are_error_verdicts_worded_as_in_process(rewards_file) -> None:
    """The same causes with and without a worker; a crash or sys.exit() in a call ends only
    that sample."""
    in_process = load_reward_function(f"{rewards_file}:score")
    in_worker = load_reward_function(f"{rewards_file}:score", timeout_s=20.0)
    modes = ["raise", "str", "none", "huge", "-huge", "exit", "print", ""]
    try:
        here = in_process.score([_sample("4", mode) for mode in modes])
        there = in_worker.score([_sample("4", mode) for mode in modes] + [_sample("4", "crash")])
    finally:
        in_worker.close()
    for verdicts in (here, there):
        statuses = [v.status for v in verdicts[: len(modes)]]
        assert statuses == ["error", "error", "unparsable", "error", "error", "error", "ok", "ok"]
        raised, text, _, huge, negative, exited = (v.error for v in verdicts[:6])
        assert raised.startswith("limit_rewards:score raised ZeroDivisionError: division by zero")
        assert raised.endswith("in score)")
        assert "returned '0.5' (a str)" in text
        assert huge.startswith("limit_rewards:score returned 1e+39, beyond float32's range")
        assert negative.startswith("limit_rewards:score returned -1e+39, beyond float32's range")
        assert exited.startswith("limit_rewards:score raised SystemExit: 0")
    assert [v.error for v in here] == [v.error for v in there[: len(modes)]]
    assert there[-1].status == "error"
    assert there[-1].error == (
        "limit_rewards:score: its worker process exited with code 3 during the call"
    )


def test_a_worker_scores_image_rows_and_streams(rewards_file) -> None:
    Image = pytest.importorskip("PIL.Image")
    fn = load_reward_function(f"{rewards_file}:score", timeout_s=1.0, num_threads=2)
    samples = [
        _sample("x", "image", image=Image.new("RGB", (4, 4), color)) for color in ("red", "blue")
    ]
    samples.append(_sample("4", "hang"))

    async def main():
        try:
            return await fn.ascore(samples)
        finally:
            await fn.aclose()

    verdicts = asyncio.run(main())
    assert [v.reward for v in verdicts[:2]] == [1.0, 0.0]
    assert verdicts[2].status == "error" and "took over timeout_s=1 s" in verdicts[2].error


def test_combined_rm_runs_a_reward_function_s_samples_on_its_workers(rewards_file) -> None:
    pid = load_reward_function(f"{rewards_file}:worker_pid", timeout_s=20.0, num_threads=2)
    score = load_reward_function(f"{rewards_file}:score", timeout_s=0.5)
    combined = CombinedRM(None, [(score, 2.0), (pid, 0.0)])
    try:
        verdicts = combined.score([_sample("4"), _sample("4", "hang"), _sample("5")])
    finally:
        score.close()
        pid.close()
    assert [v.status for v in verdicts] == ["ok", "error", "ok"]
    assert [v.reward for v in verdicts] == [2.0, 0.0, 0.0]
    assert "took over timeout_s=0.5 s" in verdicts[1].error
    # Worker processes scored them (two at once), never this process.
    pids = {v.components["limit_rewards:worker_pid"] for v in verdicts}
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids


def test_directly_given_functions_go_to_the_worker_by_reference(tmp_path, monkeypatch) -> None:
    (tmp_path / "yatt_test_limit_rewards.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import yatt_test_limit_rewards

    fn = RewardFunction(yatt_test_limit_rewards.worker_pid, timeout_s=20.0)
    # A function of a file load_reward_function ran: the worker loads that file.
    loaded = load_reward_function(f"{tmp_path / 'yatt_test_limit_rewards.py'}:score")
    again = RewardFunction(loaded.fn, timeout_s=20.0)
    try:
        assert fn.score([_sample()])[0].reward not in (0.0, float(os.getpid()))
        assert again.score([_sample("4"), _sample("5")])[0].reward == 1.0
    finally:
        fn.close()
        again.close()
    sys.modules.pop("yatt_test_limit_rewards", None)
    with pytest.raises(ValueError, match=r"cannot be pickled.*load_reward_function"):
        RewardFunction(lambda prompt, response, reference, row: 1.0, timeout_s=1.0)


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.inf, math.nan, "5", True])
def test_timeout_must_be_positive_seconds(rewards_file, timeout_s) -> None:
    with pytest.raises(ValueError, match=r"timeout_s=.*seconds a call may take"):
        load_reward_function(f"{rewards_file}:score", timeout_s=timeout_s)


@pytest.mark.parametrize(
    ("code", "match"),
    [
        ("import sys\nsys.exit(0)\n", r"running .*exits\.py failed: it called sys\.exit\(0\)"),
        ("raise KeyboardInterrupt\n", r"running .*exits\.py failed: KeyboardInterrupt"),
    ],
    ids=["sys_exit", "keyboard_interrupt"],
)
def test_a_file_that_exits_at_import_is_a_load_error(tmp_path, code, match) -> None:
    path = tmp_path / "exits.py"
    path.write_text(code + "def score(prompt, response, reference, row):\n    return 1.0\n")
    with pytest.raises(ValueError, match=f"reward function '{path}:score': {match}"):
        load_reward_function(f"{path}:score")


def test_a_module_that_exits_at_import_is_a_load_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "yatt_test_exits.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"importing 'yatt_test_exits' failed: .*sys\.exit\(0\)"):
        load_reward_function("yatt_test_exits:score")


def test_weights_that_overflow_float32_are_refused(rewards_file) -> None:
    fn = load_reward_function(f"{rewards_file}:score")
    with pytest.raises(ValueError, match=r"rules\[0\] \('limit_rewards:score'\) weight=1e\+300"):
        CombinedRM(None, [(fn, 1e300)])
    with pytest.raises(ValueError, match=r"rules\[0\] .* weight=inf"):
        CombinedRM(None, [(fn, math.inf)])
    # Each fits, their sum does not: a reward of 1 from both would overflow.
    pid = load_reward_function(f"{rewards_file}:worker_pid")
    with pytest.raises(ValueError, match=r"absolute sum is over float32's max.*weight=3e\+38"):
        CombinedRM(None, [(fn, 3e38), (pid, -2e38)])
    CombinedRM(None, [(fn, 3e38)])  # within range: allowed


def test_a_weighted_sum_beyond_float32_is_an_error_verdict(rewards_file) -> None:
    def ten(prompt, response, reference, row):
        return 10.0

    def one(prompt, response, reference, row):
        return 1.0

    combined = CombinedRM(
        None,
        [(RewardFunction(ten, name="ten"), 1e38), (RewardFunction(one, name="one"), 1.0)],
        default_reward=-1.0,
    )
    (verdict,) = combined.score([_sample()])
    assert (verdict.status, verdict.reward) == ("error", -1.0)
    assert "the weighted reward 1e+39 is beyond float32's range" in verdict.error
    assert verdict.components == {"ten": 10.0, "one": 1.0}


# -- signals: the scripts below run in a process of their own ----------------------------------

HANG_SCRIPT = """
import signal, sys, threading, time
# Ctrl-C as an interactive trainer gets it: a shell's background job (CI started with `&`)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
from yatt.genrm import Sample, load_reward_function

fn = load_reward_function(sys.argv[1] + ":score", timeout_s=600.0)
sample = Sample(prompt="q", response="r", metadata={"mode": "hang", "pid_file": sys.argv[2]})
if sys.argv[3] == "main":
    fn.score([sample])  # waits on the worker on the main thread
else:
    # A pool thread waits on the hung worker while the main thread ends without close().
    threading.Thread(target=fn.score, args=([sample],)).start()
    while True:
        try:
            open(sys.argv[2]).read() and time.sleep(0.2)
            break
        except FileNotFoundError:
            time.sleep(0.05)
"""


def _start_hung(rewards_file: Path, tmp_path: Path, where: str) -> tuple[subprocess.Popen, int]:
    """A process whose reward function hangs in its worker; (the process, the worker's pid)."""
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(HANG_SCRIPT),
            str(rewards_file),
            str(pid_file),
            where,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 45
    while not (pid_file.exists() and pid_file.read_text()):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    return process, int(pid_file.read_text())


def _is_gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # each starts a Python that imports yatt.genrm (torch): seconds
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_run_while_a_worker_hangs_and_the_worker_dies(
    rewards_file, tmp_path, sig
) -> None:
    if sig == signal.SIGTERM and not sys.platform.startswith("linux"):
        pytest.skip("a killed parent takes its busy worker along only on Linux (PDEATHSIG)")
    process, worker_pid = _start_hung(rewards_file, tmp_path, "main")
    process.send_signal(sig)
    try:
        # A hang would last the worker's 600 s timeout; 30 s leaves room for a loaded CI host.
        code = process.wait(timeout=30)
    finally:
        process.kill()
    assert code == -sig  # Python ends an unhandled KeyboardInterrupt by SIGINT too
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in process.stderr.read()
    assert _is_gone(worker_pid)


@pytest.mark.slow
def test_the_interpreter_exits_while_a_thread_waits_on_a_hung_worker(
    rewards_file, tmp_path
) -> None:
    process, worker_pid = _start_hung(rewards_file, tmp_path, "thread")
    try:
        # The main thread has ended; without killing workers first, the exit would wait out
        # the 600 s timeout in the pool thread.
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    assert _is_gone(worker_pid)


LEAKY_PY = """
import os
import subprocess
import time


def hangs_in_a_program(prompt, response, reference, row):
    child = subprocess.Popen(["sleep", "300"])
    with open(row["pid_file"], "w") as f:
        f.write(str(child.pid))
    child.wait()
    return 1.0


def forks_and_returns(prompt, response, reference, row):
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    with open(row["pid_file"], "w") as f:
        f.write(str(pid))
    return 1.0
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and process groups")
@pytest.mark.parametrize("name", ["hangs_in_a_program", "forks_and_returns"])
def test_programs_a_reward_starts_never_outlive_its_call(tmp_path, name) -> None:
    """The issue: with function_timeout_s=3 the worker was killed, its `sleep 300` was not; a
    reward that forked and returned left its child alive past close() and the trainer."""
    path = tmp_path / "leaky.py"
    path.write_text(LEAKY_PY)
    pid_file = tmp_path / "child.pid"
    fn = load_reward_function(f"{path}:{name}", timeout_s=2.0, num_threads=1)
    try:
        (verdict,) = fn.score([_sample("4", pid_file=str(pid_file))])
        stats = fn.pool_stats()
    finally:
        fn.close()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    if name == "hangs_in_a_program":
        assert verdict.status == "error" and "took over timeout_s=2 s" in verdict.error
    else:
        assert (verdict.status, verdict.reward) == ("ok", 1.0)
        assert stats["num_survivors_killed"] == 1
