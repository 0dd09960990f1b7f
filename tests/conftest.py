"""A preloaded interpreter for the scripts the integration tests launch many times.

Each `python examples/train_grpo.py ...` pays ~7 s of imports (torch, transformers, every yatt
package) before it reads its first config value; the tests launch it dozens of times. A
`ScriptRunner` imports the script's modules once in a server process, then forks that server
for each run: the fork runs the script as `__main__` with the run's argv, environment and
working directory, its stdout/stderr in files, and exits as `python script.py` would (a
traceback and 1 on an error, the interpreter's own shutdown). Runs are still separate
processes with their own exit codes; only the import is shared.

Where CUDA is visible the runner falls back to plain subprocesses (CUDA must not be
initialised before a fork, and a GPU run's imports are not what dominates).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The server: imports the script (its dependencies stay imported), forgets the script module
# itself, then per request line forks; the child leaves the loop and runs the script.
_SERVER = r"""
import importlib, json, os, sys
script, preload = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))
name = os.path.splitext(os.path.basename(script))[0]
importlib.import_module(name)
del sys.modules[name]  # run again as __main__, as `python script.py` would
for folder, module in preload:  # what the script imports only once it runs
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.import_module(module)
channel = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not corrupt the protocol
channel.write("ready\n")
channel.flush()


def serve():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        channel.write(json.dumps({"pid": pid}) + "\n")
        channel.flush()
        _, status = os.waitpid(pid, 0)
        channel.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        channel.flush()
    sys.exit(0)


request = serve()
channel.close()
os.setpgid(0, 0)  # its own group: a timeout kills the run and whatever it started
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
sys.argv = [script, *request["argv"]]
import runpy
runpy.run_path(script, run_name="__main__")
"""


_READ_AT_START = ("PYTHON", "OMP_", "MKL_")


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


class ScriptRunner:
    """`run(command, ...)` is `subprocess.run(command, ...)` for a command
    `[sys.executable, script, *argv]`, forked from a server that has the script's imports
    loaded. One run at a time."""

    def __init__(
        self, script: Path, env: dict[str, str], preload: Sequence[tuple[Path, str]] = ()
    ) -> None:
        """`preload`: (folder, module) pairs the script imports while it runs, imported in
        the server too (the folder put first on sys.path, as the script would)."""
        self.script, self.env = Path(script), env
        self._pending = b""  # read from the server, not yet a whole line
        self._server: subprocess.Popen[bytes] | None = None
        modules = [[str(folder), module] for folder, module in preload]
        if not _cuda_visible():
            self._server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(self.script), json.dumps(modules)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # read with os.read (see _read)
                env=env,
                cwd=ROOT,
            )
            assert self._read(600) == "ready", "the script's imports failed in the server"

    def _starts_alike(self, env: dict[str, str]) -> bool:
        """Whether `env` agrees with the server's on what is read only at start-up: Python's
        own variables and torch's thread counts (read when torch is imported)."""

        def at_start(values: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in values.items() if k.startswith(_READ_AT_START)}

        return at_start(env) == at_start(self.env)

    def _read(self, timeout_s: float) -> str | None:
        """The server's next line, or None after `timeout_s`. Read from the raw pipe: a
        buffered reader could hold the next line where select() no longer sees it."""
        assert self._server is not None and self._server.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            fd = self._server.stdout.fileno()
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the server of {self.script.name} exited")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def run(
        self,
        command: Sequence[str | Path],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 600,
        check: bool = False,
        capture_output: bool = False,
        text: bool = True,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        assert text, "outputs are read as text"
        command = [str(part) for part in command]
        if command[:2] != [sys.executable, str(self.script)]:
            raise ValueError(f"{command[:2]} is not [sys.executable, {str(self.script)!r}]")
        env = dict(self.env if env is None else env)
        if self._server is None or not self._starts_alike(env):
            return subprocess.run(
                command,
                env=env,
                timeout=timeout,
                check=check,
                capture_output=capture_output,
                text=True,
                cwd=cwd,
            )
        with tempfile.TemporaryDirectory(prefix="script-run-") as logs:
            request = {
                "argv": command[2:],
                "env": env,
                "cwd": str(cwd or os.getcwd()),
                "stdout": str(Path(logs) / "stdout"),
                "stderr": str(Path(logs) / "stderr"),
            }
            assert self._server.stdin is not None
            self._server.stdin.write(json.dumps(request).encode() + b"\n")
            self._server.stdin.flush()
            started = self._read(60)
            if started is None:
                raise RuntimeError(f"the server of {self.script.name} forked nothing in 60 s")
            pid = json.loads(started)["pid"]
            deadline = time.monotonic() + timeout
            reply = self._read(deadline - time.monotonic())
            if reply is None:  # as subprocess.run: kill it, then raise
                os.killpg(pid, signal.SIGKILL)
                self._read(60)
            stdout = Path(request["stdout"]).read_text(errors="replace")
            stderr = Path(request["stderr"]).read_text(errors="replace")
        if reply is None:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        returncode = json.loads(reply)["returncode"]
        if not capture_output:  # shown as the run's own output would be
            sys.stdout.write(stdout)
            sys.stderr.write(stderr)
            stdout = stderr = None
        done = subprocess.CompletedProcess(command, returncode, stdout, stderr)
        if check:
            done.check_returncode()
        return done

    def close(self) -> None:
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()


@pytest.fixture(scope="session")
def trainer() -> Iterator[ScriptRunner]:
    """examples/train_grpo.py, preloaded (OMP_NUM_THREADS=1, as the tests run it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    runner = ScriptRunner(ROOT / "examples" / "train_grpo.py", env)
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def step_bench() -> Iterator[ScriptRunner]:
    """bench/step/step.py, preloaded with what it imports as it runs (the trainer's modules)."""
    examples = ROOT / "examples"
    modules = ("torch", "transformers", "aiohttp", "yatt.core", "yatt.genrm", "yatt.testing")
    preload = [(examples, name) for name in (*modules, "train_grpo")]
    runner = ScriptRunner(ROOT / "bench" / "step" / "step.py", dict(os.environ), preload)
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def tools_task_paths(tmp_path_factory) -> dict[str, Path]:
    """The embedded multi-turn task (examples/tasks/tools_task.py: rows and the fitted policy)
    built once per session: test_multiturn_ranks.py and test_train_grpo_tools.py each built
    their own copy of the same task."""
    _import_examples()
    from tasks import tools_task

    with _built_once(tmp_path_factory, "session-tools-task") as workdir:
        return tools_task.prepare(workdir)


@pytest.fixture(scope="session")
def embedded_task(tmp_path_factory) -> dict[str, Path]:
    """The embedded text task (examples/tasks/tiny_task.py: rows, the fitted policy and judge),
    built once per session by the trainer's own `num_steps=0`, read-only afterwards: the
    build takes about a minute on CI's CPU, and test_train_grpo.py, test_train_grpo_offpolicy.py,
    test_train_self_judge.py and the off-policy bench's smoke run each built the same task
    (same code, same seed) for themselves."""
    _import_examples()
    from tasks import tiny_task

    with _built_once(tmp_path_factory, "session-text-task") as workdir:
        if not tiny_task.is_prepared(workdir / "embedded"):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            train_grpo = ROOT / "examples" / "train_grpo.py"
            command = [sys.executable, str(train_grpo), f"out_dir={workdir}", "num_steps=0"]
            subprocess.run(command, check=True, env=env)
        assert tiny_task.is_prepared(workdir / "embedded"), "num_steps=0 built no embedded task"
        return tiny_task.prepare(workdir / "embedded", None)


def _import_examples() -> None:
    """examples/ on sys.path, as the trainer puts it: its tasks import as `tasks.*`."""
    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)


@contextlib.contextmanager
def _built_once(tmp_path_factory, name: str) -> Iterator[Path]:
    """A folder for something the session builds once, held under a file lock while the
    caller builds or reuses it. Under pytest-xdist the folder is shared by the workers (the
    parent of each worker's basetemp, pytest-xdist's documented pattern), so two workers
    build it once between them, not once each."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    workdir = root / name
    workdir.mkdir(exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield workdir
