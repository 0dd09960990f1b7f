"""The worker side of yatt.rollout._user_code: the program a worker process runs, by path.

    parent (_user_code.UserCodePool)      this file, run as `python -c <bootstrap> this_file`
    --- frame (parent pid, lifeline fd, max_reply_bytes) --->  _prepare_worker: subreaper,
                                                                death signal, lifeline thread
    --- frame (request id, "load", key, target) ----------->  resolve_user_code, kept by key
    --- frame (request id, "call", key, pickled args) ----->  _Worker.call, then every child
    <-- frame (request id, pid, status, value, survivors) --  it left killed and counted

It also holds what both sides share: loading user code from its spec (so a worker loads it as
the parent does in process) and the wire format (an 8-byte length and a pickle).

This module imports only the standard library: importing yatt (torch) would add seconds to
every worker start. The parent imports it as yatt.rollout._user_code_worker; a worker runs it
as __main__.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import signal
import struct
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_FORMS = "'my_module:score' (an importable module) or 'path/to/file.py:score' (a file)"
# Names listed in a "has no attribute" error: enough to spot a typo.
_NUM_NAMES_LISTED = 12
_FRAME_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
_MODULE_PREFIX = "yatt_user_"


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
    frame of the user's code that raised it, enough to find the bug without a traceback in the
    log."""
    return f"{type(error).__name__}: {error}{raised_where(error)}"


# Where the standard library and installed packages live: frames there are not the user's.
_LIBRARY_DIRS = tuple(
    {
        os.path.realpath(path) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (path := sysconfig.get_paths().get(key))
    }
)


def raised_where(error: BaseException) -> str:
    """ " (at rewards.py:12 in score)": the innermost frame of the traceback outside the standard
    library and installed packages (a reward function whose json.loads raised is named, not
    json's decoder; a sys.exit() that another library wrapped, wandb's, is named at the call),
    else the innermost frame; "" without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    users = [f for f in frames if not os.path.realpath(f.filename).startswith(_LIBRARY_DIRS)]
    frame = (users or frames)[-1]
    return f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"


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


if __name__ == "__main__":
    serve()
