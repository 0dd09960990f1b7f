"""User code in worker processes: killed whole (its programs too), replies bound to their
request, whatever it raises an error result. Real forked children, real worker processes."""

NUM_GPUS = 0

import argparse
import asyncio
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from yatt.rollout import UserCodePool, UserCodeResult, describe_raise
from yatt.rollout._user_code import MAX_TIMEOUT_S, default_num_workers

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc"),
]

USER_PY = '''
import asyncio
import gc
import os
import pickle
import struct
import subprocess
import sys
import time


def write_pid(path, pid):
    with open(path, "w") as f:
        f.write(str(pid))


def hang_with_a_program(pid_file):
    """A call that runs a program which hangs (a sandbox running a policy's infinite loop)."""
    child = subprocess.Popen(["sleep", "300"])
    write_pid(pid_file, child.pid)
    child.wait()


def hang_with_a_hidden_grandchild(pid_file):
    """A double fork into a session of its own: not in the worker's process group."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; "
         "p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
         "open(sys.argv[1], 'w').write(str(p.pid))", pid_file]
    )
    child.wait()
    time.sleep(300)


def leave_a_child(pid_file):
    """Forks a child that outlives the call (and is not waited for)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    write_pid(pid_file, pid)
    return "done"


def fork_and_return(expected):
    """The code-execution bug: the forked child returns instead of calling os._exit()."""
    pid = os.fork()
    if pid == 0:
        return 0.123  # the child's "reward"
    os.waitpid(pid, 0)
    return expected


def forge_a_reply(value):
    """A child writes a well-formed frame into the worker's reply pipe, then the call returns."""
    worker = next(o for o in gc.get_objects() if type(o).__name__ == "_Worker")
    pid = os.fork()
    if pid == 0:
        data = pickle.dumps((12345, os.getpid(), "ok", pickle.dumps(0.123), 0))
        worker.replies.write(struct.pack("<Q", len(data)) + data)
        worker.replies.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    return value


class Base(BaseException):
    pass


def raise_(kind):
    if kind == "keyboard":
        raise KeyboardInterrupt
    if kind == "generator":
        raise GeneratorExit
    if kind == "exit":
        sys.exit(3)
    if kind == "base":
        raise Base("a BaseException subclass")
    return 1 / 0


def echo(*args, **kwargs):
    return args, kwargs


def big(num_bytes):
    return b"x" * num_bytes


def slow(seconds, value):
    time.sleep(seconds)
    return value


async def slow_async(seconds, value):
    await asyncio.sleep(seconds)
    return value


def pid():
    return os.getpid()


def num_processes_in_my_group():
    group = os.getpgid(0)
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == group:
                    count += 1
            except OSError:
                pass
    return count
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_code.py"
    path.write_text(USER_PY)
    return path


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _read_pid(path: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"no pid in {path}")


def test_a_timed_out_call_kills_the_program_it_started(user_file, tmp_path) -> None:
    pid_file = tmp_path / "sleep.pid"
    with UserCodePool(num_workers=1, timeout_s=2.0) as pool:
        result = pool.call_sync(f"{user_file}:hang_with_a_program", str(pid_file))
        assert result.status == "timeout"
        assert "timeout_s=2 s" in result.cause and "process group was killed" in result.cause
        sleep_pid = _read_pid(pid_file)
        assert _wait_dead(sleep_pid), "the program the call started outlived its timeout"
        # The pool goes on: the next call starts a new worker.
        assert pool.call_sync(f"{user_file}:echo", 1).value == ((1,), {})
        assert pool.stats()["num_timeouts"] == 1 and pool.stats()["num_worker_starts"] == 2


def test_a_timed_out_call_kills_a_grandchild_in_a_session_of_its_own(user_file, tmp_path):
    pid_file = tmp_path / "sleep.pid"
    with UserCodePool(num_workers=1, timeout_s=3.0) as pool:
        result = pool.call_sync(f"{user_file}:hang_with_a_hidden_grandchild", str(pid_file))
        assert result.status == "timeout"
        hidden = _read_pid(pid_file)
        assert _wait_dead(hidden), "a setsid() descendant outlived the timeout"


def test_a_child_left_running_after_a_call_is_killed_counted_and_reported(user_file, tmp_path):
    pid_file = tmp_path / "child.pid"
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        result = pool.call_sync(f"{user_file}:leave_a_child", str(pid_file))
        assert (result.status, result.value, result.num_survivors) == ("ok", "done", 1)
        assert _wait_dead(_read_pid(pid_file))
        assert pool.stats()["num_survivors_killed"] == 1
        # A call that leaves nothing reports nothing.
        assert pool.call_sync(f"{user_file}:echo").num_survivors == 0


def test_a_forked_child_that_returns_never_answers_for_another_call(user_file) -> None:
    """Want 1, 0, 1, 0, ... whatever the stray children do; and no process pile-up."""
    expected = [float(i % 2 == 0) for i in range(8)]
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        results = [pool.call_sync(f"{user_file}:fork_and_return", want) for want in expected]
        assert [r.status for r in results] == ["ok"] * 8
        assert [r.value for r in results] == expected
        assert pool.call_sync(f"{user_file}:num_processes_in_my_group").value == 1


def test_a_reply_from_another_process_is_dropped_and_the_worker_recycled(user_file) -> None:
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        forged = pool.call_sync(f"{user_file}:forge_a_reply", 1.0)
        # The forged 0.123 never reaches the caller: the call is an error naming the cause.
        assert forged.status == "error" and forged.value is None
        assert "stray child" in forged.cause or "reply pipe" in forged.cause
        stats = pool.stats()
        assert stats["num_stray_replies"] == 1
        after = [pool.call_sync(f"{user_file}:slow", 0.0, v) for v in (1.0, 0.0, 1.0)]
        assert [r.value for r in after] == [1.0, 0.0, 1.0]
        assert pool.stats()["num_worker_starts"] == 2


@pytest.mark.parametrize("kind", ["keyboard", "generator", "exit", "base", "zero"])
@pytest.mark.parametrize("in_process", [False, True], ids=["worker", "in_process"])
def test_whatever_user_code_raises_is_an_error_result(user_file, kind, in_process) -> None:
    timeout_s = None if in_process else 20.0
    with UserCodePool(num_workers=1, timeout_s=timeout_s, in_process=in_process) as pool:
        result = pool.call_sync(f"{user_file}:raise_", kind)
        assert result.status == "error"
        want = {
            "keyboard": "raised KeyboardInterrupt",
            "generator": "raised GeneratorExit",
            "exit": "raised SystemExit: 3",
            "base": "raised Base: a BaseException subclass",
            "zero": "raised ZeroDivisionError: division by zero",
        }[kind]
        assert result.cause.startswith(want) and result.cause.endswith("in raise_)")
        assert pool.call_sync(f"{user_file}:echo", 2).value == ((2,), {})
        asyncio.run(_async_raise(pool, f"{user_file}:raise_", kind))


async def _async_raise(pool: UserCodePool, target: str, kind: str) -> None:
    assert (await pool.call(target, kind)).status == "error"


def test_a_reply_over_max_reply_bytes_is_an_error(user_file) -> None:
    with UserCodePool(num_workers=1, timeout_s=20.0, max_reply_bytes=10_000) as pool:
        assert pool.call_sync(f"{user_file}:big", 1000).value == b"x" * 1000
        result = pool.call_sync(f"{user_file}:big", 50_000)
        assert result.status == "error" and "over max_reply_bytes=10000" in result.cause
        assert pool.stats()["num_worker_starts"] == 1  # refused in the worker, not a crash


@pytest.mark.parametrize("name", ["slow", "slow_async"])
@pytest.mark.parametrize("in_process", [False, True], ids=["worker", "in_process"])
def test_calls_run_concurrently(user_file, in_process, name) -> None:
    """16 calls of 0.3 s on 4 workers: about 4 x 0.3 s, not 16 x 0.3 s = 4.8 s."""
    timeout_s = None if in_process else 30.0
    target = f"{user_file}:{name}"
    with UserCodePool(num_workers=4, timeout_s=timeout_s, in_process=in_process) as pool:

        async def run(seconds: float, num_calls: int) -> list[UserCodeResult]:
            return await asyncio.gather(*(pool.call(target, seconds, i) for i in range(num_calls)))

        # Start the workers first: a start costs a Python process, not what is measured here.
        asyncio.run(run(0.05, 4))
        begin = time.monotonic()
        results = asyncio.run(run(0.3, 16))
        elapsed = time.monotonic() - begin
    assert [r.value for r in results] == list(range(16))
    assert elapsed < 3.6, f"{elapsed:.2f} s for 16 calls of 0.3 s on 4 workers: serial"


def test_async_user_code_in_process_and_in_a_worker(user_file) -> None:
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        result = pool.call_sync(f"{user_file}:slow_async", 0.0, "v")
        assert (result.status, result.value) == ("ok", "v")
        assert pool.call_sync(f"{user_file}:pid").value != os.getpid()
    with UserCodePool(num_workers=1, timeout_s=None, in_process=True) as pool:
        assert pool.call_sync(f"{user_file}:slow_async", 0.0, "v").value == "v"
        assert pool.call_sync(f"{user_file}:pid").value == os.getpid()


def test_a_file_may_import_a_module_beside_it(tmp_path) -> None:
    (tmp_path / "yatt_test_helper_beside.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "main_code.py").write_text(
        "import yatt_test_helper_beside\n\n\ndef score(x):\n"
        "    return yatt_test_helper_beside.double(x)\n"
    )
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        assert pool.call_sync(f"{tmp_path / 'main_code.py'}:score", 21).value == 42
    sys.modules.pop("yatt_test_helper_beside", None)


def test_inputs_a_worker_cannot_take_are_bad_input(user_file) -> None:
    # Deeper than any interpreter's recursion limit lets pickle go: 900 levels pickled in some
    # environments (the reply then failed in the worker: an error, not bad input) and not in
    # others, as the caller's stack depth counts toward the limit.
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        deep = pool.call_sync(f"{user_file}:echo", nested)
        assert deep.status == "bad_input" and "RecursionError" in deep.cause
        lock = pool.call_sync(f"{user_file}:echo", lambda: 1)
        assert lock.status == "bad_input"
        assert pool.stats()["num_bad_inputs"] == 2 and pool.stats()["num_errors"] == 0


def test_close_kills_a_call_in_progress_and_its_program(user_file, tmp_path) -> None:
    pid_file = tmp_path / "sleep.pid"
    pool = UserCodePool(num_workers=1, timeout_s=600.0)

    async def main():
        task = asyncio.ensure_future(pool.call(f"{user_file}:hang_with_a_program", str(pid_file)))
        sleep_pid = await asyncio.to_thread(_read_pid, pid_file)
        pool.close()
        return await task, sleep_pid

    result, sleep_pid = asyncio.run(main())
    assert result.status == "error" and "was closed" in result.cause
    assert _wait_dead(sleep_pid)
    assert pool.call_sync(f"{user_file}:echo").status == "error"


EXIT_SCRIPT = """
import sys, threading, time
from yatt.rollout import UserCodePool
pool = UserCodePool(num_workers=1, timeout_s=600.0)
threading.Thread(
    target=pool.call_sync, args=(sys.argv[1] + ":hang_with_a_program", sys.argv[2]), daemon=True
).start()
while True:
    try:
        if open(sys.argv[2]).read():
            break
    except FileNotFoundError:
        pass
    time.sleep(0.05)
if sys.argv[3] == "kill":
    time.sleep(600)  # killed by the test
"""


@pytest.mark.parametrize("how", ["exit", "kill"], ids=["interpreter_exit", "sigkill"])
def test_the_programs_die_with_the_process_that_made_the_pool(user_file, tmp_path, how) -> None:
    pid_file = tmp_path / "sleep.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), str(user_file), str(pid_file), how],
        env=env,
    )
    sleep_pid = _read_pid(pid_file, timeout_s=60.0)
    if how == "kill":
        process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) in (0, -signal.SIGKILL)
    assert _wait_dead(sleep_pid), "the program a worker ran outlived the trainer"


@pytest.mark.parametrize(
    "timeout_s", [0, -1.0, math.inf, math.nan, 1e10, MAX_TIMEOUT_S * 2, "5", True]
)
def test_timeout_is_bounded_seconds(timeout_s) -> None:
    with pytest.raises(ValueError, match=r"timeout_s=.*seconds a call may take"):
        UserCodePool(num_workers=1, timeout_s=timeout_s)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match=r"num_workers=0: must be an int >= 1"):
        UserCodePool(num_workers=0)
    with pytest.raises(ValueError, match=r"in_process=True"):
        UserCodePool(num_workers=1, timeout_s=5.0, in_process=True)
    with pytest.raises(ValueError, match=r"max_reply_bytes=0"):
        UserCodePool(num_workers=1, max_reply_bytes=0)
    # Never more workers than the CPUs this process may use.
    assert 1 <= default_num_workers() <= len(os.sched_getaffinity(0))


def test_a_function_defined_in_main_or_a_lambda_is_refused_by_name() -> None:
    with UserCodePool(num_workers=1, timeout_s=5.0) as pool:
        assert pool.cannot_send(lambda: 1).startswith("it cannot be pickled")
        assert pool.cannot_send(os.getpid) is None  # a module function goes by reference
        assert pool.call_sync(os.getpid).value != os.getpid()


def test_a_call_may_have_its_own_timeout(user_file) -> None:
    with UserCodePool(num_workers=1, timeout_s=60.0) as pool:
        result = pool.call_within_sync(0.5, f"{user_file}:slow", 30.0, "late")
        assert result.status == "timeout" and "timeout_s=0.5 s" in result.cause
        quick = asyncio.run(pool.call_within(20.0, f"{user_file}:slow", 0.0, "v"))
        assert (quick.status, quick.value) == ("ok", "v")
        with pytest.raises(ValueError, match=r"timeout_s=10000000000.0: seconds"):
            pool.call_within_sync(1e10, f"{user_file}:echo")


def test_workers_use_one_math_thread_unless_told(user_file, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    with UserCodePool(num_workers=1, timeout_s=20.0) as pool:
        env = pool.call_sync("os:getenv", "OMP_NUM_THREADS").value
        assert env == "1" and pool.call_sync("os:getenv", "MKL_NUM_THREADS").value == "3"


def test_the_worker_program_imports_only_the_standard_library() -> None:
    # A worker runs _user_code_worker.py by path: an import of yatt (torch) there would add
    # seconds to every worker start, and one of the package's modules would run its __init__.
    import ast

    from yatt.rollout import _user_code_worker

    tree = ast.parse(Path(_user_code_worker.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_describe_raise_names_the_users_frame_not_the_librarys(tmp_path) -> None:
    # A user's function whose error is raised inside the standard library (json's decoder) or
    # inside a library that wraps sys.exit (wandb does, in site-packages): the cause names the
    # user's line. Lines counted by hand in the file below.
    user = tmp_path / "user_rewards.py"
    user.write_text(
        textwrap.dedent(
            """\
            import json


            def parse(text):
                return json.loads(text)


            def quit_through(exit_hook):
                exit_hook(0)
            """
        )
    )
    spec = importlib.util.spec_from_file_location("user_rewards", user)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError) as caught:
        module.parse("{not json")
    cause = describe_raise(caught.value)
    assert cause.startswith("JSONDecodeError: Expecting property name")
    assert cause.endswith("(at user_rewards.py:5 in parse)")
    with pytest.raises(SystemExit) as caught:
        module.quit_through(argparse.ArgumentParser().exit)  # sys.exit inside argparse.py
    assert describe_raise(caught.value) == "SystemExit: 0 (at user_rewards.py:9 in quit_through)"
    # Nothing but library frames (this test's frame cut off): the innermost one, as before.
    with pytest.raises(ValueError) as caught:
        json.loads("[")
    error = caught.value.with_traceback(caught.value.__traceback__.tb_next)
    assert "(at decoder.py:" in describe_raise(error)
