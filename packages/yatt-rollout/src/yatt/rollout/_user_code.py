"""User code (reward functions, tools, environments) in worker processes that can be killed whole.

    pool = UserCodePool(num_workers=4, timeout_s=10.0)
    result = await pool.call("path/to/rewards.py:score", prompt, response)   # or call_sync
    result.status, result.value, result.cause     # "ok" | "error" | "timeout" | "bad_input"
    pool.stats()                                  # counts: calls, timeouts, killed survivors, ...
    pool.close()                                  # every worker's process group killed

    parent (any thread)                               worker (this file, run by path; stdlib only)
    call(target, *args) -- pickled args --> idle worker ---frame (request id, target, args)--->
        waits <= timeout_s on the reply pipe           loads target once ("file.py:qualname")
        reply's (request id, worker pid) checked  <--- calls it (awaits a coroutine), one reply
        no reply in time: SIGKILL the worker's         kills what the call left running
        process group and every descendant             (its own children: it is a subreaper)

Why each piece:
- A worker starts in a session of its own (its pid is its process group), so a program the user
  code runs (`subprocess.run(["sleep", "300"])`) is in that group and dies with it: at a call's
  timeout, at `close()`, and at interpreter exit (atexit and a weakref finalizer). A worker is
  also a child subreaper (Linux): a double-forked or setsid() descendant is re-parented to it and
  is found and killed after the call, however it hid from the group.
- A reply carries the request's id and the worker's pid; anything else on the pipe (a forked
  child that returned into our loop instead of calling os._exit) is dropped, counted, and the
  worker recycled. Such a child cannot even write: the loop checks its pid after each call and
  a process that is not the worker leaves with os._exit at once.
- Whatever user code raises (BaseException included: SystemExit, KeyboardInterrupt,
  GeneratorExit) is an "error" result with a one-line cause, in a worker and in process.
- A reply over `max_reply_bytes` is an error (the worker does not send it); arguments that
  cannot be pickled or unpickled are "bad_input" (the input's fault, not the code's).

Frames are an 8-byte length and a pickle, over the worker's stdin and a copy of its stdout; the
worker points fd 1 at stderr and fd 0 at /dev/null, so `print` in user code cannot corrupt them.
A lifeline pipe (its write end held only by the parent) ends the worker's group when the parent
goes, even if it is killed (PR_SET_PDEATHSIG is the backstop). Workers are started from one
long-lived thread: Linux sends the death signal when the *thread* that started a child ends.

This module imports only the standard library: it is also the worker's program, and importing
yatt (torch) would add seconds to every worker start.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import logging
import os
import pickle
import queue
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
from typing import Any, Literal

logger = logging.getLogger("yatt.rollout")

SPEC_FORMS = "'my_module:score' (an importable module) or 'path/to/file.py:score' (a file)"
UserCodeStatus = Literal["ok", "error", "timeout", "bad_input"]
# A worker imports the user's module before its first call; that can take a model load.
LOAD_TIMEOUT_S = 300.0
# Longer than any call should wait, short enough that select() and monotonic sums stay exact.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_MAX_REPLY_BYTES = 16 << 20
# Default worker count: the CPUs this process may use, at most this many (each worker is a
# Python process; more than the cores oversubscribes the machine the trainer runs on).
MAX_DEFAULT_WORKERS = 8
# Names listed in a "has no attribute" error: enough to spot a typo.
_NUM_NAMES_LISTED = 12
_FRAME_HEADER = struct.Struct("<Q")
# Room for the frame's own fields around a reply's value.
_FRAME_OVERHEAD_BYTES = 4096
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
_MODULE_PREFIX = "yatt_user_"
# Run the worker as this file, with the parent's sys.path: `-m yatt.rollout...` would import the
# package (seconds), and running the file directly would put this folder first on sys.path.
_BOOTSTRAP = (
    "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)


def default_num_workers() -> int:
    """The CPUs this process may run on (its affinity), at most MAX_DEFAULT_WORKERS."""
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        num_cpus = os.cpu_count() or 1
    return max(1, min(num_cpus, MAX_DEFAULT_WORKERS))


@dataclasses.dataclass(frozen=True)
class UserCodeResult:
    """What one call of user code gave.

    status "ok": `value` is what it returned (a coroutine's result, for an async function);
    "error": it raised (any BaseException), its worker died, or its reply was too large or
    could not be read; "timeout": it outlived timeout_s and its process group was killed;
    "bad_input": its arguments could not be sent to a worker. `cause` says which, in one line.
    `num_survivors`: processes the call left running, killed after it (each one a leak)."""

    status: UserCodeStatus
    value: Any = None
    cause: str | None = None
    num_survivors: int = 0
    elapsed_s: float = 0.0

    @property
    def is_ok(self) -> bool:
        return self.status == "ok"


# -- loading user code from its spec (here so that a worker loads it as the parent does) --------


def resolve_user_code(spec: str, *, what: str = "user code") -> tuple[Any, str]:
    """(the object at `spec`, its default name). "module:attr" is imported; "path/file.py:attr"
    is run as a module of its own, once per process, with the file's folder importable (the
    file may import a module beside it). ValueError naming `what` and the fix otherwise."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"{what} {spec!r}: write {SPEC_FORMS}")
    # The last colon: a Windows path has one of its own ("C:\\rewards.py:score").
    source, attr = spec.rsplit(":", 1)
    if not source or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"{what} {spec!r}: write {SPEC_FORMS}")
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    if is_file:
        module = _load_file(spec, source, what)
        default_name = f"{Path(source).stem}:{attr}"
    else:
        module = _import_module(spec, source, what)
        default_name = spec
    target: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(target, part):
            where = source if i == 0 else f"{source}:{'.'.join(attr.split('.')[:i])}"
            raise ValueError(
                f"{what} {spec!r}: {where} has no attribute {part!r}"
                + (f"; it has {_public_callables(target)}" if i == 0 else "")
            )
        target = getattr(target, part)
    return target, default_name


def _describe_exit(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {error}"


def _import_module(spec: str, module_name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name != missing and not module_name.startswith(missing + "."):
            # The module exists; something it imports does not.
            raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {e}") from e
        file = Path(*module_name.split(".")).with_suffix(".py")
        hint = (
            f"; {file} is in the working directory: write '{file}:{spec.rsplit(':', 1)[1]}' "
            "(a file path) or run with PYTHONPATH=."
            if file.is_file()
            else "; install it, put its folder on PYTHONPATH, or give a file path "
            "'path/to/file.py:name'"
        )
        raise ValueError(f"{what} {spec!r}: no module named {module_name!r}{hint}") from None
    except BaseException as e:  # SystemExit too: importing a module must not end the run
        raise ValueError(
            f"{what} {spec!r}: importing {module_name!r} failed: {_describe_exit(e)}"
        ) from e


def _load_file(spec: str, source: str, what: str) -> ModuleType:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: there is no file {path}")
    # One module per file path, so loading the same file twice runs it once.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"{_MODULE_PREFIX}{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    # As `python path/file.py` does: a module beside the file is importable from it.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise ValueError(f"{what} {spec!r}: {path} cannot be loaded as Python")
    module = importlib.util.module_from_spec(import_spec)
    # Registered before it runs, as an import does: dataclasses and pickling look it up.
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit too: a user's file must not end the run
        del sys.modules[module_name]
        raise ValueError(f"{what} {spec!r}: running {path} failed: {_describe_exit(e)}") from e
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


def spec_of(target: Any) -> str | None:
    """ "file.py:qualname" for a function of a file `resolve_user_code` loaded (its module name
    is ours, importable nowhere else), else None."""
    module = sys.modules.get(getattr(target, "__module__", None) or "")
    qualname = getattr(target, "__qualname__", "")
    file = getattr(module, "__file__", None)
    if module is None or not module.__name__.startswith(_MODULE_PREFIX):
        return None
    if not file or "<locals>" in qualname:
        return None
    return f"{file}:{qualname}"


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


class _Worker:
    """The worker process's state: loaded targets and an event loop for async user code."""

    def __init__(self, replies: Any, max_reply_bytes: int) -> None:
        self.pid = os.getpid()
        self.replies = replies
        self.max_reply_bytes = max_reply_bytes
        self.targets: dict[bytes, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def load(self, key: bytes, target: tuple[str, Any]) -> tuple[str, Any]:
        try:
            kind, payload = target
            loaded = resolve_user_code(payload)[0] if kind == "spec" else pickle.loads(payload)
        except BaseException as e:
            return "error", str(e) if isinstance(e, ValueError) else describe_raise(e)
        self.targets[key] = loaded
        return "ok", None

    def call(self, key: bytes, args_blob: bytes) -> tuple[str, Any]:
        try:
            args, kwargs = pickle.loads(args_blob)
        except BaseException as e:
            return "bad_input", f"its arguments cannot be read in the worker ({describe_raise(e)})"
        try:
            value = self.targets[key](*args, **kwargs)
            if inspect.isawaitable(value):
                if self.loop is None:
                    self.loop = asyncio.new_event_loop()
                value = self.loop.run_until_complete(_awaited(value))
        except BaseException as e:  # SystemExit, KeyboardInterrupt, GeneratorExit: its error
            self.leave_if_forked()
            return "error", f"raised {describe_raise(e)}"
        self.leave_if_forked()
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:
            return "error", f"returned a {type(value).__name__} that cannot be pickled ({e})"
        if len(blob) > self.max_reply_bytes:
            return "error", (
                f"returned {len(blob)} bytes (pickled), over max_reply_bytes="
                f"{self.max_reply_bytes}; return less"
            )
        return "ok", blob

    def leave_if_forked(self) -> None:
        """A forked child of the user code that returned into this loop instead of calling
        os._exit: it must not read requests nor write replies. It leaves at once."""
        if os.getpid() != self.pid:
            os._exit(0)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _reap_and_kill_children() -> int:
    """Kill (SIGKILL) every process still a child of this one (adopted orphans too: this process
    is a subreaper) and reap them; how many were alive."""
    killed: set[int] = set()
    for _ in range(20):  # a child may fork while we kill; a few rounds catch its offspring
        _reap_zombies()
        children = _children_of(os.getpid())
        if not children:
            break
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.001)
    _reap_zombies()
    return len(killed)


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children_of(pid: int) -> list[int]:
    """Live (not zombie) children of `pid`, from /proc (Linux); [] where it cannot tell."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return [child for child in children if _state_of(child) not in ("Z", None)]


def _state_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: the state follows the last ")".
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] or None


def _descendants_of(pid: int) -> list[int]:
    found: list[int] = []
    stack = [pid]
    while stack and len(found) < 100_000:
        for child in _children_of(stack.pop()):
            found.append(child)
            stack.append(child)
    return found


def _kill_own_group(*_: Any) -> None:
    """End this worker and everything it started: its adopted orphans, then its group."""
    with contextlib.suppress(Exception):
        for pid in _descendants_of(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _watch_lifeline(fd: int) -> None:
    """Blocks until the parent's end of the lifeline closes (the parent exited or was killed)."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    _kill_own_group()


def _prepare_worker(parent_pid: int, lifeline_fd: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the lifeline still ends the worker's group
    signal.signal(signal.SIGTERM, _kill_own_group)
    # Ctrl-C reaches the trainer's whole foreground group; the trainer decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_lifeline, args=(lifeline_fd,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent went before prctl took effect
        _kill_own_group()


def serve() -> None:
    """The worker's loop: answer load and call frames until stdin closes."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # print() in user code goes to the trainer's stderr
    start = _read_frame(requests)
    if start is None:
        return
    parent_pid, lifeline_fd, max_reply_bytes = start
    _prepare_worker(parent_pid, lifeline_fd)
    worker = _Worker(replies, max_reply_bytes)
    while (request := _read_frame(requests)) is not None:
        request_id, kind, key, payload = request
        if kind == "load":
            status, value = worker.load(key, payload)
            num_survivors = 0
        else:
            status, value = worker.call(key, payload)
            num_survivors = _reap_and_kill_children()
        worker.leave_if_forked()
        _write_frame(replies, (request_id, worker.pid, status, value, num_survivors))


# -- the parent's side ------------------------------------------------------------------------

# Started from this one thread, which lives as long as the process: see the module docstring.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="yatt-spawner")
_live_pools: weakref.WeakSet[UserCodePool] = weakref.WeakSet()
_request_ids = itertools.count(1)


def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()


# Closed before the interpreter joins its worker threads at exit, so a thread waiting on a hung
# worker returns at once instead of after its timeout (threading._register_atexit is what
# concurrent.futures uses for that phase), and again at atexit for pools made later.
getattr(threading, "_register_atexit", lambda hook: None)(_close_live_pools)
atexit.register(_close_live_pools)


class _Stray(Exception):
    """A frame on the reply pipe that does not answer the request in flight."""


class _Process:
    """One worker process, one caller at a time (the pool hands it out)."""

    def __init__(self, pool_stats: dict[str, int], max_reply_bytes: int) -> None:
        self._stats = pool_stats
        self._max_reply_bytes = max_reply_bytes
        self.popen: subprocess.Popen[bytes] | None = None
        self._lifeline_w: int | None = None
        self._buffer = bytearray()
        self._loaded: set[bytes] = set()
        self._lock = threading.Lock()  # guards popen between a caller and close()

    def _start(self) -> None:
        lifeline_r, lifeline_w = os.pipe()
        try:
            self.popen = _spawner.submit(self._spawn, lifeline_r).result()
        finally:
            os.close(lifeline_r)
        self._lifeline_w = lifeline_w
        self._stats["num_worker_starts"] += 1
        assert self.popen.stdin is not None
        _write_frame(self.popen.stdin, (os.getpid(), lifeline_r, self._max_reply_bytes))

    @staticmethod
    def _spawn(lifeline_r: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, __file__, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(lifeline_r,),
            start_new_session=True,  # its own session and process group, killed whole
        )

    def request(self, kind: str, key: bytes, payload: Any, timeout_s: float) -> tuple[Any, ...]:
        """The worker's (status, value, num_survivors), or ("timeout", None, 0) and
        ("died", how, 0) after which the worker is gone. Starts the worker when needed."""
        if self.popen is None:
            self._start()
        assert self.popen is not None and self.popen.stdin is not None
        request_id = next(_request_ids)
        try:
            _write_frame(self.popen.stdin, (request_id, kind, key, payload))
        except (BrokenPipeError, ValueError, OSError):  # ValueError: closed from another thread
            cause = self._exit_cause()
            self.kill()
            return "died", cause, 0
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._receive(deadline)
            except _Stray as e:
                self._stats["num_stray_replies"] += 1
                logger.warning(
                    "a worker process's reply pipe carried %s; it was dropped and the worker "
                    "recycled (a forked child that returned instead of calling os._exit?)",
                    e,
                )
                self.kill()
                return "died", f"its reply pipe carried {e}", 0
            if reply == "timeout":
                self.kill()
                return "timeout", None, 0
            if reply is None:
                cause = self._exit_cause()
                self.kill()
                return "died", cause, 0
            reply_id, pid, status, value, num_survivors = reply
            if reply_id != request_id or pid != self.popen.pid:
                self._stats["num_stray_replies"] += 1
                logger.warning(
                    "a reply for request %s from pid %s while waiting for request %s from "
                    "worker %s: dropped, and the worker recycled (a forked child that returned "
                    "instead of calling os._exit?)",
                    reply_id,
                    pid,
                    request_id,
                    self.popen.pid,
                )
                self.kill()
                return "died", "another process wrote into its reply pipe (a stray child)", 0
            return status, value, num_survivors

    def ensure_loaded(self, key: bytes, target: tuple[str, Any]) -> tuple[str, Any]:
        if self.popen is not None and key in self._loaded:
            return "ok", None
        if self.popen is None:
            self._loaded.clear()
        status, value, _ = self.request("load", key, target, LOAD_TIMEOUT_S)
        if status == "ok":
            self._loaded.add(key)
        elif status == "timeout":
            value = f"the worker process took over {LOAD_TIMEOUT_S:g} s to load it"
        elif status == "died":
            value = f"the worker process {value} while loading it"
        return status, value

    def _receive(self, deadline: float) -> Any:
        """The next reply; "timeout" past `deadline`; None when the worker is gone."""
        popen = self.popen
        if popen is None or popen.stdout is None:
            return None
        fd = popen.stdout.fileno()
        header = self._read_exactly(fd, _FRAME_HEADER.size, deadline)
        if not isinstance(header, bytes):
            return header
        (size,) = _FRAME_HEADER.unpack(header)
        if size > self._max_reply_bytes + _FRAME_OVERHEAD_BYTES:
            raise _Stray(f"a frame of {size} bytes, over max_reply_bytes")
        data = self._read_exactly(fd, size, deadline)
        if not isinstance(data, bytes):
            return data
        try:
            reply = pickle.loads(data)
        except Exception as e:
            raise _Stray(f"a frame that does not unpickle ({type(e).__name__})") from None
        if not (isinstance(reply, tuple) and len(reply) == 5):
            raise _Stray(f"a {type(reply).__name__} that is not a reply")
        return reply

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
        popen = self.popen
        if popen is None:
            return "was closed"
        try:
            code = popen.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "closed its output"
        if code < 0:
            return f"died of signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """SIGKILL the worker's process group and every descendant that left it; idempotent,
        from any thread."""
        with self._lock:
            popen, self.popen = self.popen, None
            lifeline, self._lifeline_w = self._lifeline_w, None
        self._buffer.clear()
        self._loaded.clear()
        if popen is None:
            return
        _kill_tree(popen.pid)
        with contextlib.suppress(Exception):
            popen.wait(timeout=5.0)
        for stream in (popen.stdin, popen.stdout):
            with contextlib.suppress(OSError, ValueError):
                stream.close()  # type: ignore[union-attr]
        if lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(lifeline)


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group (a worker leads its own) and its descendants outside it."""
    descendants = _descendants_of(pid)  # read before the kill: then they are orphans
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


class UserCodePool:
    """Runs user code: in `num_workers` worker processes (each its own process group, started
    at first need and kept), or with `in_process=True` in this process (no start-up, no
    pickling, no timeout: a call that hangs hangs its caller).

    `target` is a spec "path/to/file.py:qualname" / "module:attr" (loaded once per worker, the
    file's folder importable) or a callable pickled by reference (defined at the top level of an
    importable module). It may be sync or async. `timeout_s` bounds each call (worker mode);
    `max_reply_bytes` the pickled value it returns. Thread-safe; `call` never blocks the event
    loop. Results are `UserCodeResult`s: nothing user code does raises here (but a Ctrl-C that
    reaches a waiting `call_sync`)."""

    def __init__(
        self,
        *,
        num_workers: int | None = None,
        timeout_s: float | None = 60.0,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        in_process: bool = False,
        name: str = "user code",
    ) -> None:
        if num_workers is None:
            num_workers = default_num_workers()
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r}: must be an int >= 1")
        if in_process:
            if timeout_s is not None:
                raise ValueError(
                    f"timeout_s={timeout_s!r} with in_process=True: a call in this process "
                    "cannot be stopped; use timeout_s=None, or worker processes"
                )
        else:
            check_timeout_s("timeout_s", timeout_s)
        is_int = isinstance(max_reply_bytes, int) and not isinstance(max_reply_bytes, bool)
        if not (is_int and max_reply_bytes >= 1):
            raise ValueError(f"max_reply_bytes={max_reply_bytes!r}: must be an int >= 1")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.is_in_process = in_process
        self.name = name
        self._stats = {
            "num_calls": 0,
            "num_ok": 0,
            "num_errors": 0,
            "num_timeouts": 0,
            "num_bad_inputs": 0,
            "num_worker_starts": 0,
            "num_workers_died": 0,
            "num_survivors_killed": 0,
            "num_stray_replies": 0,
        }
        self._stats_lock = threading.Lock()
        self._is_closed = False
        self._has_warned_survivors = False
        self._processes = [_Process(self._stats, max_reply_bytes) for _ in range(num_workers)]
        # Last in, first out: serial calls reuse one started worker instead of starting all.
        self._idle: queue.LifoQueue[_Process] = queue.LifoQueue()
        for process in self._processes:
            self._idle.put(process)
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="yatt-user-code"
        )
        # id(target) -> (target, key, how): the target is held so that its id is not reused.
        self._targets: dict[int, tuple[Any, bytes, tuple[str, Any]]] = {}
        self._resolved: dict[str, Any] = {}  # in process: spec -> the object it names
        _live_pools.add(self)
        # Kills the workers if the pool is dropped without close() (a finalizer holds no
        # reference to the pool itself).
        self._finalizer = weakref.finalize(self, _kill_processes, self._processes)

    # -- calling -------------------------------------------------------------------------
    def call_sync(self, target: Any, /, *args: Any, **kwargs: Any) -> UserCodeResult:
        """`target(*args, **kwargs)` on the calling thread's behalf; waits for the result."""
        begin = time.monotonic()
        if self.is_in_process:
            result = _call_here_sync(self._resolve_here(target), args, kwargs)
        else:
            result = self._call_in_worker(target, args, kwargs)
        return self._count(dataclasses.replace(result, elapsed_s=time.monotonic() - begin))

    async def call(self, target: Any, /, *args: Any, **kwargs: Any) -> UserCodeResult:
        """`call_sync` without blocking the event loop: calls run concurrently, up to
        `num_workers` at once."""
        begin = time.monotonic()
        if self.is_in_process:
            target = self._resolve_here(target)
        if self.is_in_process and _is_async_callable(target):
            result = await _call_here_async(target, args, kwargs)
        else:
            loop = asyncio.get_running_loop()
            if self.is_in_process:
                function = _call_here_sync
            else:
                function = self._call_in_worker
            result = await loop.run_in_executor(self._threads, function, target, args, kwargs)
        return self._count(dataclasses.replace(result, elapsed_s=time.monotonic() - begin))

    def _resolve_here(self, target: Any) -> Any:
        """In process: the object a spec names (loaded once), or a function raising why not."""
        if not isinstance(target, str):
            return target
        if target not in self._resolved:
            try:
                self._resolved[target] = resolve_user_code(target, what=self.name)[0]
            except ValueError as e:
                message = str(e)

                def cannot_load(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError(message)

                return cannot_load
        return self._resolved[target]

    def _count(self, result: UserCodeResult) -> UserCodeResult:
        key = {
            "ok": "num_ok",
            "error": "num_errors",
            "timeout": "num_timeouts",
            "bad_input": "num_bad_inputs",
        }[result.status]
        with self._stats_lock:
            self._stats["num_calls"] += 1
            self._stats[key] += 1
            self._stats["num_survivors_killed"] += result.num_survivors
        if result.num_survivors and not self._has_warned_survivors:
            self._has_warned_survivors = True
            logger.warning(
                "%s left %d process(es) running after its call; they were killed (counted in "
                "num_survivors_killed). Wait for the processes you start before returning.",
                self.name,
                result.num_survivors,
            )
        return result

    def _target_of(self, target: Any) -> tuple[bytes, tuple[str, Any]] | str:
        """(a key naming it, how a worker loads it), or why it cannot go to a worker."""
        cached = self._targets.get(id(target))
        if cached is not None and cached[0] is target:
            return cached[1], cached[2]
        if isinstance(target, str):
            how: tuple[str, Any] = ("spec", target)
        elif (spec := spec_of(target)) is not None:
            how = ("spec", spec)
        elif getattr(target, "__module__", None) == "__main__":
            return "it is defined in __main__; define it in a module and name it by its spec"
        else:
            try:
                how = ("pickle", pickle.dumps(target, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:
                return f"it cannot be pickled ({type(e).__name__}: {e})"
        key = hashlib.sha1(pickle.dumps(how)).digest()
        if not isinstance(target, str):
            self._targets[id(target)] = (target, key, how)
        return key, how

    def check_target(self, target: Any) -> None:
        """ValueError when `target` cannot be sent to a worker process (in process: never)."""
        if self.is_in_process:
            return
        found = self._target_of(target)
        if isinstance(found, str):
            raise ValueError(f"{self.name} runs in worker processes, but {found}")

    def _call_in_worker(self, target: Any, args: tuple, kwargs: dict) -> UserCodeResult:
        if self._is_closed:
            return UserCodeResult("error", cause=f"{self.name} was closed")
        found = self._target_of(target)
        if isinstance(found, str):
            return UserCodeResult("error", cause=f"cannot run in a worker process: {found}")
        key, how = found
        try:
            args_blob = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # RecursionError for deep nesting, a lock, a generator ...
            return UserCodeResult(
                "bad_input",
                cause=f"its input cannot be sent to a worker process (pickle: "
                f"{type(e).__name__}: {e})",
            )
        process = self._idle.get()
        try:
            if self._is_closed:
                return UserCodeResult("error", cause=f"{self.name} was closed")
            status, value = process.ensure_loaded(key, how)
            if status != "ok":
                if status == "died":
                    self._count_died()
                return UserCodeResult("error", cause=f"cannot run in a worker process: {value}")
            timeout_s = self.timeout_s if self.timeout_s is not None else MAX_TIMEOUT_S
            status, value, num_survivors = process.request("call", key, args_blob, timeout_s)
        except BaseException:
            process.kill()  # Ctrl-C while waiting: the worker's state is unknown
            raise
        finally:
            self._idle.put(process)
        if status == "timeout":
            return UserCodeResult(
                "timeout",
                cause=f"took over timeout_s={self.timeout_s:g} s; its worker process group "
                "was killed (the next call starts a new one)",
            )
        if status == "died":
            self._count_died()
            cause = "was closed" if self._is_closed else value
            return UserCodeResult("error", cause=f"its worker process {cause} during the call")
        if status != "ok":
            return UserCodeResult(status, cause=value, num_survivors=num_survivors)
        try:
            result = pickle.loads(value)
        except BaseException as e:
            return UserCodeResult(
                "error",
                cause=f"its return value cannot be read here ({describe_raise(e)})",
                num_survivors=num_survivors,
            )
        return UserCodeResult("ok", value=result, num_survivors=num_survivors)

    def _count_died(self) -> None:
        with self._stats_lock:
            self._stats["num_workers_died"] += 1

    # -- state and teardown --------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counts since the pool was made: calls by result, worker starts and deaths, processes
        killed after their call (leaks), and replies dropped for not answering their request."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        """Kill every worker's process group (a call in progress ends as an error); later calls
        are errors. Idempotent, from any thread."""
        self._is_closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._finalizer()

    def __enter__(self) -> UserCodePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _kill_processes(processes: list[_Process]) -> None:
    for process in processes:
        process.kill()


def check_timeout_s(field: str, timeout_s: object) -> None:
    """ValueError unless `timeout_s` is seconds in (0, MAX_TIMEOUT_S]."""
    is_number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
    if not (is_number and 0 < timeout_s <= MAX_TIMEOUT_S):  # type: ignore[operator]
        raise ValueError(
            f"{field}={timeout_s!r}: seconds a call may take, > 0 and at most "
            f"{MAX_TIMEOUT_S:g} (a week)"
        )


def _is_async_callable(target: Any) -> bool:
    if inspect.iscoroutinefunction(target):
        return True
    if inspect.isroutine(target) or not callable(target):
        return False
    return inspect.iscoroutinefunction(type(target).__call__)


def _error_of(error: BaseException) -> UserCodeResult:
    return UserCodeResult("error", cause=f"raised {describe_raise(error)}")


def _call_here_sync(target: Any, args: tuple, kwargs: dict) -> UserCodeResult:
    try:
        value = target(*args, **kwargs)
        if inspect.isawaitable(value):
            value = _run_coroutine(value)
    except BaseException as e:  # SystemExit, KeyboardInterrupt, GeneratorExit: its error
        return _error_of(e)
    return UserCodeResult("ok", value=value)


def _run_coroutine(awaitable: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(awaitable))
    # Called from a running loop's thread: run it on a loop of its own in another thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as one:
        return one.submit(asyncio.run, _awaited(awaitable)).result()


async def _call_here_async(target: Any, args: tuple, kwargs: dict) -> UserCodeResult:
    try:
        value = await target(*args, **kwargs)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # our caller was cancelled, not the user code's own raise
        return UserCodeResult("error", cause="raised CancelledError")
    except BaseException as e:
        return _error_of(e)
    return UserCodeResult("ok", value=value)


if __name__ == "__main__":
    serve()
