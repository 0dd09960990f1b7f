"""User code (reward functions, tools, environments) in worker processes that can be killed whole.

    pool = UserCodePool(num_workers=4, timeout_s=10.0)
    result = await pool.call("path/to/rewards.py:score", prompt, response)   # or call_sync
    result.status, result.value, result.cause     # "ok" | "error" | "timeout" | "bad_input"
    pool.stats()                                  # counts: calls, timeouts, killed survivors, ...
    pool.close()                                  # every worker's process group killed

    parent (any thread)                          worker (_user_code_worker.py, run by path)
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

This module is the parent's side (UserCodePool); the worker's program, and what both sides
share (loading a spec, the frames), is yatt.rollout._user_code_worker, standard library only.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Literal

from yatt.rollout import _user_code_worker
from yatt.rollout._user_code_worker import (
    _FRAME_HEADER,
    _awaited,
    _descendants_of,
    _write_frame,
    describe_raise,
    resolve_user_code,
    spec_of,
)

logger = logging.getLogger("yatt.rollout")

UserCodeStatus = Literal["ok", "error", "timeout", "bad_input"]
# A worker imports the user's module before its first call; that can take a model load.
LOAD_TIMEOUT_S = 300.0
# Longer than any call should wait, short enough that select() and monotonic sums stay exact.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_MAX_REPLY_BYTES = 16 << 20
# Default worker count: the CPUs this process may use, at most this many (each worker is a
# Python process; more than the cores oversubscribes the machine the trainer runs on).
MAX_DEFAULT_WORKERS = 8
# Room for the frame's own fields around a reply's value.
_FRAME_OVERHEAD_BYTES = 4096
# Run the worker as its file, with the parent's sys.path: `-m yatt.rollout...` would import the
# package (seconds), and running the file directly would put its folder first on sys.path.
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
            [sys.executable, "-c", _BOOTSTRAP, _user_code_worker.__file__, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(lifeline_r,),
            start_new_session=True,  # its own session and process group, killed whole
            env=_worker_env(),
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
        if self.popen is not None and self.popen.poll() is not None:
            # Died while idle (the OOM killer between steps): replaced at no call's cost.
            self._stats["num_workers_died"] += 1
            self.kill()
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


def _worker_env() -> dict[str, str]:
    """The parent's environment, with one thread per math library unless the user set it: a
    worker importing numpy or torch would otherwise start a thread per core, and workers x
    cores threads oversubscribe the machine the trainer runs on."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


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

    # For packages built on the pool (genrm's reward functions, tools): the same rules.
    DEFAULT_MAX_REPLY_BYTES = DEFAULT_MAX_REPLY_BYTES
    MAX_TIMEOUT_S = MAX_TIMEOUT_S
    default_num_workers = staticmethod(default_num_workers)
    resolve = staticmethod(resolve_user_code)  # (spec, what=) -> (object, default name)

    @staticmethod
    def check_timeout_s(field: str, timeout_s: object) -> None:
        """ValueError naming `field` unless `timeout_s` is seconds in (0, MAX_TIMEOUT_S]."""
        check_timeout_s(field, timeout_s)

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
        return self._run_sync(target, args, kwargs, None)

    async def call(self, target: Any, /, *args: Any, **kwargs: Any) -> UserCodeResult:
        """`call_sync` without blocking the event loop: calls run concurrently, up to
        `num_workers` at once."""
        return await self._run_async(target, args, kwargs, None)

    def call_within_sync(
        self, timeout_s: float, target: Any, /, *args: Any, **kwargs: Any
    ) -> UserCodeResult:
        """`call_sync` with this call's own timeout (a tool's), instead of the pool's."""
        return self._run_sync(target, args, kwargs, self._checked_call_timeout(timeout_s))

    async def call_within(
        self, timeout_s: float, target: Any, /, *args: Any, **kwargs: Any
    ) -> UserCodeResult:
        """`call` with this call's own timeout (a tool's), instead of the pool's."""
        return await self._run_async(target, args, kwargs, self._checked_call_timeout(timeout_s))

    def _checked_call_timeout(self, timeout_s: float) -> float:
        if self.is_in_process:
            raise ValueError(
                f"timeout_s={timeout_s!r} for one call of an in_process pool: a call in this "
                "process cannot be stopped; use worker processes"
            )
        check_timeout_s("timeout_s", timeout_s)
        return timeout_s

    def _run_sync(
        self, target: Any, args: tuple, kwargs: dict, timeout_s: float | None
    ) -> UserCodeResult:
        begin = time.monotonic()
        if self.is_in_process:
            result = _call_here_sync(self._resolve_here(target), args, kwargs)
        else:
            result = self._call_in_worker(target, args, kwargs, timeout_s)
        return self._count(dataclasses.replace(result, elapsed_s=time.monotonic() - begin))

    async def _run_async(
        self, target: Any, args: tuple, kwargs: dict, timeout_s: float | None
    ) -> UserCodeResult:
        begin = time.monotonic()
        if self._is_closed:
            return self._count(self._closed_result())
        if self.is_in_process:
            target = self._resolve_here(target)
        if self.is_in_process and _is_async_callable(target):
            result = await _call_here_async(target, args, kwargs)
        else:
            loop = asyncio.get_running_loop()
            if self.is_in_process:
                call = functools.partial(_call_here_sync, target, args, kwargs)
            else:
                call = functools.partial(self._call_in_worker, target, args, kwargs, timeout_s)
            result = await loop.run_in_executor(self._threads, call)
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

    def cannot_send(self, target: Any) -> str | None:
        """Why `target` cannot be sent to a worker process ("it cannot be pickled (...)"), or
        None when it can (in process: always None)."""
        if self.is_in_process:
            return None
        found = self._target_of(target)
        return found if isinstance(found, str) else None

    def call_many_sync(
        self, calls: Sequence[tuple[Any, tuple, dict[str, Any]]]
    ) -> list[UserCodeResult]:
        """`call_sync(target, *args, **kwargs)` for each (target, args, kwargs), run
        concurrently (num_workers at once); results in order."""
        if self._is_closed:
            return [self._count(self._closed_result()) for _ in calls]
        futures = [
            self._threads.submit(self.call_sync, target, *args, **kwargs)
            for target, args, kwargs in calls
        ]
        return [future.result() for future in futures]

    def _closed_result(self) -> UserCodeResult:
        return UserCodeResult("error", cause=f"{self.name} was closed")

    def _call_in_worker(
        self, target: Any, args: tuple, kwargs: dict, timeout_s: float | None = None
    ) -> UserCodeResult:
        if self._is_closed:
            return self._closed_result()
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
                return self._closed_result()
            status, value = process.ensure_loaded(key, how)
            if status != "ok":
                if status == "died":
                    self._count_died()
                return UserCodeResult("error", cause=f"cannot run in a worker process: {value}")
            if timeout_s is None:
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
                cause=f"took over timeout_s={timeout_s:g} s; its worker process group "
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
