"""A reward function in a process of its own, so a call that hangs can be killed.

    parent (RewardFunction, timeout_s set)              worker (this file, run by path)
    FunctionWorker.call(rows, timeout_s) --frame-->     load fn once (spec or pickle)
        waits <= timeout_s for each reply <--frame--    fn(prompt, response, reference, row)
        no reply in time: SIGKILL, restart, go on       one reply per row, in order

A hung Python call cannot be stopped in a thread, and a process that still has one such thread
never exits; a process can be killed. The worker is persistent (one start per function and thread,
and again after each kill), and one frame carries a whole list of rows. Frames are an 8-byte
length and a pickle, over the worker's stdin and a copy of its stdout; the worker points its own
fd 1 at stderr and fd 0 at /dev/null, so `print` and `input` in a reward function cannot corrupt
them.

The worker dies with the trainer: it asks Linux for SIGKILL when its parent goes
(PR_SET_PDEATHSIG), and leaves when its stdin closes. Linux sends that signal when the *thread*
that started the child ends, so workers are started from one long-lived spawner thread.

This module imports only the standard library: it is also the worker's program, and importing
yatt.genrm (torch, through yatt.rollout) would add seconds to every start and restart.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import json
import numbers
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_FORMS = "'my_module:score' (an importable module) or 'path/to/rewards.py:score' (a file)"
# Names listed in an "has no attribute" error: enough to spot a typo.
_NUM_NAMES_LISTED = 12
_FRAME_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# A worker imports the reward module before it can answer; that can take a model load.
WORKER_START_TIMEOUT_S = 300.0
# Run the worker as this file, with the parent's sys.path: `-m yatt.genrm...` would import the
# package (seconds), and running the file directly would put this folder first on sys.path.
_BOOTSTRAP = (
    "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)


# -- loading a function from its spec (here so that the worker loads it as the parent does) ----


def resolve_function(spec: str) -> tuple[Any, str]:
    """(the object at `spec`, its default name). "module:attr" is imported; "path/file.py:attr"
    is run as a module of its own, once per process. ValueError saying what to fix otherwise."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"reward function {spec!r}: write {SPEC_FORMS}")
    # The last colon: a Windows path has one of its own ("C:\\rewards.py:score").
    source, attr = spec.rsplit(":", 1)
    if not source or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"reward function {spec!r}: write {SPEC_FORMS}")
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    if is_file:
        module = _load_file(spec, source)
        default_name = f"{Path(source).stem}:{attr}"
    else:
        module = _import_module(spec, source)
        default_name = spec
    fn: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(fn, part):
            where = source if i == 0 else f"{source}:{'.'.join(attr.split('.')[:i])}"
            raise ValueError(
                f"reward function {spec!r}: {where} has no attribute {part!r}"
                + (f"; it has {_public_callables(fn)}" if i == 0 else "")
            )
        fn = getattr(fn, part)
    return fn, default_name


def _describe_exit(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {error}"


def _import_module(spec: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name != missing and not module_name.startswith(missing + "."):
            # The module exists; something it imports does not.
            raise ValueError(
                f"reward function {spec!r}: importing {module_name!r} failed: {e}"
            ) from e
        file = Path(*module_name.split(".")).with_suffix(".py")
        hint = (
            f"; {file} is in the working directory: write '{file}:{spec.rsplit(':', 1)[1]}' "
            "(a file path) or run with PYTHONPATH=."
            if file.is_file()
            else "; install it, put its folder on PYTHONPATH, or give a file path "
            "'path/to/rewards.py:score'"
        )
        raise ValueError(
            f"reward function {spec!r}: no module named {module_name!r}{hint}"
        ) from None
    except BaseException as e:  # SystemExit too: importing a module must not end the run
        raise ValueError(
            f"reward function {spec!r}: importing {module_name!r} failed: {_describe_exit(e)}"
        ) from e


def _load_file(spec: str, source: str) -> ModuleType:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward function {spec!r}: there is no file {path}")
    # One module per file path, so loading the same file twice runs it once.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"yatt_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise ValueError(f"reward function {spec!r}: {path} cannot be loaded as Python")
    module = importlib.util.module_from_spec(import_spec)
    # Registered before it runs, as an import does: dataclasses and pickling look it up.
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit too: a reward file must not end the run
        del sys.modules[module_name]
        raise ValueError(
            f"reward function {spec!r}: running {path} failed: {_describe_exit(e)}"
        ) from e
    return module


def _public_callables(module: object) -> str:
    names = sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and callable(value)
        and getattr(value, "__module__", None) == getattr(module, "__name__", None)
    )
    if not names:
        return "no public functions"
    listed = ", ".join(names[:_NUM_NAMES_LISTED])
    return listed + (", ..." if len(names) > _NUM_NAMES_LISTED else "")


def describe_raise(error: BaseException) -> str:
    """ "ZeroDivisionError: division by zero (at rewards.py:12 in score)": the exception and the
    frame that raised it, enough to find the bug without a traceback in the log."""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        frame = frames[-1]
        where = f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return f"{type(error).__name__}: {error}{where}"


# -- the wire: length-prefixed pickles --------------------------------------------------------


def _write_frame(stream: Any, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: Any) -> Any:
    """The next message, or None at end of stream."""
    header = stream.read(_FRAME_HEADER.size)
    if len(header) < _FRAME_HEADER.size:
        return None
    (size,) = _FRAME_HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


# -- the worker's side ------------------------------------------------------------------------


def _call(fn: Any, row_blob: bytes) -> tuple[str, Any]:
    """("value", float | None), ("not_a_number", what it was) or ("raised", cause)."""
    try:
        prompt, response, reference, row = pickle.loads(row_blob)
        value = fn(prompt, response, reference, row)
    except BaseException as e:  # sys.exit() or KeyboardInterrupt in a function: its error
        return "raised", describe_raise(e)
    if value is None:
        return "value", None
    if isinstance(value, numbers.Real):
        try:
            return "value", float(value)
        except Exception as e:
            return "raised", describe_raise(e)
    return "not_a_number", f"{value!r:.80} (a {type(value).__name__})"


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the closed stdin still ends an idle worker
    if os.getppid() != parent_pid:  # the parent went before prctl took effect
        os._exit(1)


def serve() -> None:
    """The worker's loop: load the function the first frame names, then answer call frames
    until stdin closes."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # print() in a reward function goes to the trainer's stderr
    # Ctrl-C reaches the whole process group; the trainer decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = _read_frame(requests)
    if start is None:
        return
    kind, target, parent_pid = start
    _die_with_parent(parent_pid)
    try:
        fn = resolve_function(target)[0] if kind == "spec" else pickle.loads(target)
    except BaseException as e:
        message = str(e) if isinstance(e, ValueError) else describe_raise(e)
        _write_frame(replies, ("failed", message))
        return
    _write_frame(replies, ("ready", None))
    while (rows := _read_frame(requests)) is not None:
        for row_blob in rows:
            _write_frame(replies, _call(fn, row_blob))


# -- the parent's side ------------------------------------------------------------------------

# Started from this one thread, which lives as long as the process: see the module docstring.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="yatt-spawner")
_live_workers: weakref.WeakSet[FunctionWorker] = weakref.WeakSet()


def _kill_live_workers() -> None:
    for worker in list(_live_workers):
        worker.close()


# Killed before the interpreter joins its worker threads at exit, so a thread waiting on a hung
# worker returns at once instead of after its timeout. threading._register_atexit is what
# concurrent.futures itself uses for this phase; atexit runs only after those joins.
getattr(threading, "_register_atexit", lambda hook: None)(_kill_live_workers)


class FunctionWorker:
    """One worker process for one function: `call` sends rows and waits for each reply.

    One caller at a time (RewardFunction keeps one worker per thread). `close` may come from
    any thread: it kills the process, and a caller waiting on it gets "failed" replies."""

    def __init__(self, target: tuple[str, Any]) -> None:
        self._target = target  # ("spec", "module:attr") or ("pickle", bytes of the function)
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = bytearray()
        self._start_failure: str | None = None
        self._is_closed = False
        self._call_lock = threading.Lock()  # held by the caller; close() cleans up when free
        self.num_starts = 0
        _live_workers.add(self)

    def call(self, rows: list[bytes], timeout_s: float) -> list[tuple[str, Any]]:
        """One reply per pickled row, in order: what `_call` gives, or ("timeout", None),
        ("died", how), ("failed", why it could not start). A row whose call outlives `timeout_s`
        gets "timeout"; its worker is killed and the rows after it go to a new one."""
        replies: list[tuple[str, Any]] = []
        with self._call_lock:
            try:
                num_send_failures = 0
                while len(replies) < len(rows):
                    pending = rows[len(replies) :]
                    if not self._ensure_started():
                        cause = self._start_failure or "the reward function was closed"
                        replies.extend(("failed", cause) for _ in pending)
                        break
                    if not self._send(pending):
                        # Died while idle; a second failure in a row is the row's fault.
                        num_send_failures += 1
                        if num_send_failures > 1:
                            replies.append(("died", self._exit_cause()))
                        self._kill()
                        continue
                    num_send_failures = 0
                    for _ in pending:
                        reply = self._receive(time.monotonic() + timeout_s)
                        if reply == "timeout":
                            replies.append(("timeout", None))
                        elif reply is None:
                            replies.append(("died", self._exit_cause()))
                        else:
                            replies.append(reply)
                            continue
                        self._kill()
                        break
            except BaseException:
                self._kill()  # Ctrl-C while waiting: the worker's state is unknown
                raise
        return replies

    def close(self) -> None:
        """Kill the worker; later calls get "failed" replies."""
        self._is_closed = True
        process = self._process
        if process is not None:
            process.kill()  # a caller waiting on it reads end-of-stream at once
        if self._call_lock.acquire(blocking=False):
            try:
                self._kill()
            finally:
                self._call_lock.release()

    def _ensure_started(self) -> bool:
        if self._process is not None:
            return True
        if self._start_failure is not None or self._is_closed:
            return False
        try:
            self._process = _spawner.submit(self._spawn).result()
            self.num_starts += 1
            _write_frame(self._process.stdin, (*self._target, os.getpid()))
            reply = self._receive(time.monotonic() + WORKER_START_TIMEOUT_S)
        except (OSError, RuntimeError) as e:  # RuntimeError: the interpreter is shutting down
            reply = ("failed", f"the worker process could not start: {e}")
        if reply == ("ready", None):
            return True
        if reply is None:
            reply = ("failed", f"the worker process {self._exit_cause()} while loading")
        elif reply == "timeout":
            reply = ("failed", f"the worker process took over {WORKER_START_TIMEOUT_S:g} s to load")
        self._kill()
        if not self._is_closed:
            self._start_failure = reply[1]
        return False

    @staticmethod
    def _spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, __file__, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def _send(self, rows: list[bytes]) -> bool:
        process = self._process
        assert process is not None and process.stdin is not None
        try:
            _write_frame(process.stdin, rows)
        except (BrokenPipeError, ValueError):  # ValueError: closed from another thread
            return False
        return True

    def _receive(self, deadline: float) -> Any:
        """The next reply; "timeout" past `deadline`; None when the worker is gone."""
        process = self._process
        if process is None or process.stdout is None:
            return None
        header = self._read_exactly(process.stdout.fileno(), _FRAME_HEADER.size, deadline)
        if not isinstance(header, bytes):
            return header
        (size,) = _FRAME_HEADER.unpack(header)
        data = self._read_exactly(process.stdout.fileno(), size, deadline)
        return pickle.loads(data) if isinstance(data, bytes) else data

    def _read_exactly(self, fd: int, size: int, deadline: float) -> bytes | str | None:
        # select + os.read, not a blocking read: the wait ends at the deadline, and Ctrl-C on
        # the main thread interrupts it.
        while len(self._buffer) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            try:
                readable, _, _ = select.select([fd], [], [], remaining)
                chunk = os.read(fd, 1 << 20) if readable else b""
            except (OSError, ValueError):  # the fd was closed by close() on another thread
                return None
            if readable and not chunk:
                return None
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _exit_cause(self) -> str:
        process = self._process
        if process is None or self._is_closed:
            return "was closed"
        try:
            code = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "closed its output"
        if code < 0:
            return f"died of signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def _kill(self) -> None:
        process, self._process = self._process, None
        self._buffer.clear()
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]


if __name__ == "__main__":
    serve()
