"""Running a trajectory's environment and tools where they cannot stop the run.

    driver --open(kind)--> EnvSession --reset / call / get_reward, each with a timeout-->  user code
                              |                                                    (a worker)
                              '-- a result, or ToolFailure(cause, message): never an exception

A session holds one environment instance (one trajectory). `PoolToolRunner` runs each call in
a yatt.rollout.UserCodePool worker (its own process group, killed at the timeout; the
instance's attributes travel with the call). `ThreadToolRunner` runs each call on a daemon
thread of its own (tests, trusted tools, environments that do not pickle): a tool that hangs is
abandoned at its timeout (the thread runs on), and the trajectory goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from yatt.rollout.env._images import ImageInputs, ImageResultError, ToolImages
from yatt.rollout.env._tools import EnvKind

# Why a call failed: the metric keys of MultiTurnStats.tool_errors. The image causes
# (env/_images.py): "image_too_large" (its tokens alone exceed the observation cap),
# "image_unsupported" (the policy takes no images), "bad_image" (the image processor refused
# it, or a content part is neither an image nor text).
FAILURE_CAUSES = (
    "timeout",
    "exception",
    "unknown_tool",
    "bad_arguments",
    "malformed",
    "image_too_large",
    "image_unsupported",
    "bad_image",
)


@dataclass(frozen=True)
class ToolFailure:
    cause: str  # one of FAILURE_CAUSES
    message: str  # what the model reads as the observation


class EnvSession(Protocol):
    async def reset(self, row: dict[str, Any], *, timeout_s: float) -> Any: ...
    async def call(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> Any | ToolFailure: ...
    async def get_reward(self, *, timeout_s: float) -> Any: ...
    def is_done(self) -> bool: ...
    def close(self) -> None: ...


class ToolRunner(Protocol):
    def open(self, kind: EnvKind) -> EnvSession: ...


class ToolTimeoutError(TimeoutError):
    pass


async def run_in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a fresh daemon thread; ToolTimeoutError after `timeout_s`.

    Not asyncio.to_thread: its pool is shared and small, and a hung call would hold a slot.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def report(ok: bool, value: Any) -> None:
        # the loop may have closed (the call was cancelled and its run ended): nobody waits
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, ok, value)

    def work() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # user code; reported to the driver
            report(False, e)
        else:
            report(True, result)

    threading.Thread(target=work, name="yatt-tool", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        raise ToolTimeoutError(f"no answer within {timeout_s:g} s") from None


class ThreadSession:
    """One trajectory's environment instance, its calls on threads."""

    def __init__(self, kind: EnvKind) -> None:
        self.kind = kind
        self.env: Any = None

    async def reset(self, row: dict[str, Any], *, timeout_s: float) -> Any:
        if self.kind.factory is None:
            return None

        def build_and_reset() -> Any:
            self.env = self.kind.factory()
            return self.env.reset(**row) if callable(getattr(self.env, "reset", None)) else None

        return await run_in_thread(build_and_reset, timeout_s=timeout_s)

    async def call(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> Any | ToolFailure:
        fn = self._tool(name)
        if fn is None:
            known = ", ".join(self.kind.tool_names)
            return ToolFailure(
                "unknown_tool", f"Error: unknown tool {name!r}; the tools are {known}"
            )
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return ToolFailure("bad_arguments", f"Error: wrong arguments for {name}: {e}")
        try:
            return await run_in_thread(fn, timeout_s=timeout_s, **arguments)
        except ToolTimeoutError as e:
            return ToolFailure("timeout", f"Error: {name} timed out ({e})")
        except Exception as e:  # user code: the model sees what went wrong
            return ToolFailure("exception", f"Error: {name} raised {type(e).__name__}: {e}")

    async def get_reward(self, *, timeout_s: float) -> Any:
        return await run_in_thread(self.env.get_reward, timeout_s=timeout_s)

    def is_done(self) -> bool:
        return bool(getattr(self.env, "done", False)) if self.env is not None else False

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        self.env = None
        if callable(close):
            with contextlib.suppress(Exception):  # a failing close must not end the run
                close()

    def _tool(self, name: str) -> Callable[..., Any] | None:
        if name in self.kind.functions:
            return self.kind.functions[name]
        if self.env is not None and name in self.kind.tool_names:
            return getattr(self.env, name)
        return None


class ThreadToolRunner:
    """Sessions whose calls run on threads of this process (tests, trusted in-process tools)."""

    def open(self, kind: EnvKind) -> EnvSession:
        return ThreadSession(kind)


def format_output(result: Any, *, max_bytes: int, max_tokens: int, tokenizer: Any) -> str:
    """A tool's result as the observation text: str as is, anything else as JSON, cut to
    `max_bytes` UTF-8 bytes and then `max_tokens` tokens (a note says it was cut)."""
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result, default=str)
        except (TypeError, ValueError):
            text = str(result)
    data = text.encode("utf-8")
    was_cut = False
    if len(data) > max_bytes:
        text = data[:max_bytes].decode("utf-8", errors="ignore")
        was_cut = True
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
        was_cut = True
    return text + " ...[output truncated]" if was_cut else text


def format_image_output(
    parts: list[dict[str, Any]],
    *,
    max_bytes: int,
    max_tokens: int,
    tokenizer: Any,
    images: ToolImages | None,
) -> tuple[list[dict[str, Any]], ImageInputs]:
    """A tool's image result (content parts, env/_images.py) as the observation's parts and its
    images processed. The images' tokens count first against `max_tokens`: ImageResultError
    ("image_too_large") when they alone exceed it; the text parts, in order, share the tokens
    left and `max_bytes` (cut as format_output cuts, the rest of the text dropped).
    ImageResultError ("image_unsupported") when the policy takes no images (`images` None)."""
    if images is None:
        raise ImageResultError(
            "the tool returned an image, but the policy takes no images (a vision-language "
            "model's image processor is needed)",
            cause="image_unsupported",
        )
    inputs = images.encode([p["image"] for p in parts if p["type"] == "image"])
    num_image_tokens = sum(images.tokens_per_image(inputs))
    if num_image_tokens > max_tokens:
        raise ImageResultError(
            f"the tool's image takes {num_image_tokens} tokens, over the observation cap of "
            f"{max_tokens} tokens; return a smaller image",
            cause="image_too_large",
        )
    left_bytes, left_tokens = max_bytes, max_tokens - num_image_tokens
    out: list[dict[str, Any]] = []
    was_cut = False
    for part in parts:
        if part["type"] == "image":
            out.append(part)
            continue
        if was_cut:
            continue  # the text budget is spent
        text = part["text"]
        data = text.encode("utf-8")
        if len(data) > left_bytes:
            text = data[:left_bytes].decode("utf-8", errors="ignore")
            was_cut = True
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > left_tokens:
            ids = ids[:left_tokens]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            was_cut = True
        left_bytes -= len(text.encode("utf-8"))
        left_tokens -= len(ids)
        text = text + " ...[output truncated]" if was_cut else text
        out.append({"type": "text", "text": text})
    return out, inputs


# Workers load the step functions from this file by path (see _env_step.py).
_STEP_FILE = str(Path(__file__).with_name("_env_step.py"))


class PoolSession:
    """One trajectory's environment, every call in a UserCodePool worker (killed at its timeout).

    The instance's attributes travel with each call (they must pickle); `timeout_s` is the
    pool's (UserCodePool(timeout_s=EnvConfig.tool_timeout_s)).
    """

    def __init__(self, pool: Any, kind: EnvKind) -> None:
        self.pool = pool
        self.kind = kind
        self.state: dict[str, Any] | None = None

    async def reset(self, row: dict[str, Any], *, timeout_s: float) -> Any:
        if self.kind.factory is None:
            return None
        result = await self.pool.call(f"{_STEP_FILE}:reset", self._class_spec(), row)
        if result.status != "ok":
            raise RuntimeError(f"reset {result.status}: {result.cause}")
        self.state, first = result.value
        return first

    async def call(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> Any | ToolFailure:
        is_function = name in self.kind.functions
        if is_function:
            local, bound = self.kind.functions[name], arguments
        elif self.state is not None and name in self.kind.tool_names:
            local, bound = getattr(self.kind.factory, name), {"self": None, **arguments}
        else:
            known = ", ".join(self.kind.tool_names)
            return ToolFailure(
                "unknown_tool", f"Error: unknown tool {name!r}; the tools are {known}"
            )
        try:
            inspect.signature(local).bind(**bound)
        except TypeError as e:
            return ToolFailure("bad_arguments", f"Error: wrong arguments for {name}: {e}")
        if is_function:
            target = self.kind.function_specs.get(name) or local
            result = await self.pool.call(target, **arguments)
        else:
            step = f"{_STEP_FILE}:call"
            result = await self.pool.call(step, self._class_spec(), self.state, name, arguments)
        if result.status == "timeout":
            return ToolFailure("timeout", f"Error: {name} timed out ({result.cause})")
        if result.status != "ok":
            return ToolFailure("exception", f"Error: {name} failed: {result.cause}")
        if is_function:
            return result.value
        self.state, value = result.value
        return value

    async def get_reward(self, *, timeout_s: float) -> Any:
        result = await self.pool.call(f"{_STEP_FILE}:get_reward", self._class_spec(), self.state)
        if result.status != "ok":
            raise RuntimeError(f"get_reward {result.status}: {result.cause}")
        return result.value

    def is_done(self) -> bool:
        return bool((self.state or {}).get("done", False))

    def close(self) -> None:
        self.state = None

    def _class_spec(self) -> str:
        if self.kind.spec is None:
            raise RuntimeError(
                f"environment {self.kind.name!r} cannot be loaded by a worker process: define "
                "it at the top level of a module or file"
            )
        return self.kind.spec


class PoolToolRunner:
    """Sessions whose every call runs in `pool`'s worker processes (yatt.rollout.UserCodePool):
    a tool that hangs, crashes or starts processes is killed with its worker's process group."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @classmethod
    def from_timeout(
        cls, tool_timeout_s: float, *, num_workers: int | None = None
    ) -> PoolToolRunner:
        """A runner over a new pool whose calls time out after `tool_timeout_s` (close it with
        `runner.pool.close()`)."""
        from yatt.rollout._user_code import UserCodePool

        return cls(UserCodePool(num_workers=num_workers, timeout_s=tool_timeout_s, name="tools"))

    def check_kind(self, kind: EnvKind) -> None:
        """ValueError when a worker process cannot load the environment class or a tool."""
        if kind.factory is not None and kind.spec is None:
            raise ValueError(
                f"EnvConfig.environment: {kind.name!r} runs in worker processes but is defined "
                "inside a function or in __main__; define it at the top level of a module or "
                "file and name it by its spec ('my_env.py:Name')"
            )
        for name, fn in kind.functions.items():
            if kind.function_specs.get(name) is None:
                self.pool.check_target(fn)

    def open(self, kind: EnvKind) -> EnvSession:
        return PoolSession(self.pool, kind)
