"""Plain Python reward functions, scored like a judge.

    def score(prompt: str, response: str, reference: str | None, row: dict) -> float | None: ...

    fn = load_reward_function("my_module:score")    # or "path/to/rewards.py:score"
    fn.score(samples)                               # verdicts, as GenRM.score gives
    CombinedRM(None, [(fn, 1.0), (load_reward_function("my_module:fmt"), 0.2)])  # no judge

`row` is the sample's data row (`Sample.metadata`); treat it as read-only. What a call returns
becomes the verdict's status:

    a finite number (a bool counts as 0/1)  -> "ok", that reward
    None ("cannot score this sample")       -> "unparsable", `default_reward`, `error` says so
    raises, or returns a str, NaN, inf, ... -> "error", `default_reward`, `error` is the cause

so `ScoreStats` counts unscorable samples with the judge's unparsable ones and failures with the
judge's errors, and a broken function never stops a run. The signature is checked when the
function is loaded, not at the first sample.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer, per_sample_batching
from yatt.genrm._types import Sample, Verdict
from yatt.genrm._verifiers import call_rule, check_reward
from yatt.genrm._votes import FailureLog

RewardFn = Callable[[str, str, str | None, dict[str, Any]], float | None]

_SPEC_FORMS = "'my_module:score' (an importable module) or 'path/to/rewards.py:score' (a file)"
_CALL_FORM = "fn(prompt, response, reference, row)"
# Names listed in an "has no attribute" error: enough to spot a typo.
_NUM_NAMES_LISTED = 12


class RewardFunction(StreamingScorer):
    """A scorer (score / submit / finish / results / ascore, as GenRM) that calls
    `fn(prompt, response, reference, row)` for each sample; also a rule for `CombinedRM`.

    Streaming calls `fn` on `num_threads` worker threads (default 1: `fn` need not be
    thread-safe), never on the event loop, so a slow function does not stall a rollout stream
    running beside it.
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        name: str | None = None,
        default_reward: float = 0.0,
        num_threads: int = 1,
        batching: BatchingConfig | None = None,
    ) -> None:
        if name is None:
            name = getattr(fn, "__qualname__", None) or type(fn).__name__
        if not isinstance(name, str) or not name or name == "judge":
            raise ValueError(f"name={name!r}: must be a non-empty str other than 'judge'")
        check_reward_function(fn, name)
        if not math.isfinite(default_reward):
            raise ValueError(f"default_reward={default_reward!r}: must be finite")
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1")
        # Each sample is scored on its own; num_threads bounds how many at once.
        super().__init__(
            batching=batching or per_sample_batching(),
            error_reward=default_reward,
        )
        self.fn = fn
        self.name = name
        self.default_reward = default_reward
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="yatt-genrm-reward"
        )
        self._error_log = FailureLog("rule failure")

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r})"

    def verify(self, sample: Sample) -> float | None:
        """`fn`'s reward for `sample`; raises what `fn` raises, InvalidRewardError (a
        ValueError) when it returns something other than a finite number or None."""
        return check_reward(
            self.fn(sample.prompt, sample.response, sample.reference, sample.metadata)
        )

    def _verdict(self, sample: Sample) -> Verdict:
        reward, cause = call_rule(self, sample)
        components = {self.name: reward}
        if cause is not None:
            self._error_log.record(sample.id, cause)
            return Verdict(
                sample_id=sample.id,
                reward=self.default_reward,
                status="error",
                error=cause,
                components=components,
            )
        if reward is None:
            return Verdict(
                sample_id=sample.id,
                reward=self.default_reward,
                status="unparsable",
                error=f"{self.name} returned None (cannot score this sample)",
                components=components,
            )
        return Verdict(sample_id=sample.id, reward=reward, status="ok", components=components)

    def score(self, samples: Sequence[Sample]) -> list[Verdict]:
        """Verdicts in order, computed on the calling thread."""
        verdicts = [self._verdict(sample) for sample in samples]
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    async def _judge_batch(self, items: list[Item]) -> None:
        loop = asyncio.get_running_loop()

        async def score_one(item: Item) -> None:
            item.resolve(await loop.run_in_executor(self._pool, self._verdict, item.sample))

        await asyncio.gather(*(score_one(item) for item in items))

    def close(self) -> None:
        """Stop the worker threads (a call in progress finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        await super().aclose()
        self.close()


def check_reward_function(fn: object, name: str) -> None:
    """ValueError unless `fn` can be called as fn(prompt, response, reference, row)."""
    if inspect.isclass(fn):
        raise ValueError(
            f"reward function {name!r} is a class; point at a function, or make an instance "
            f"in your module and point at it (its __call__ is {_CALL_FORM})"
        )
    if not callable(fn):
        raise ValueError(
            f"reward function {name!r} is not callable (its type is {type(fn).__name__}); "
            f"point at a function {_CALL_FORM}"
        )
    is_async_call = not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    if inspect.iscoroutinefunction(fn) or is_async_call:
        raise ValueError(
            f"reward function {name!r} is async; give a plain function (it runs on worker "
            "threads, so blocking I/O in it does not stall the event loop)"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: a wrong one shows up as an error verdict
    try:
        signature.bind(None, None, None, None)
    except TypeError as e:
        raise ValueError(
            f"reward function {name}{signature} cannot be called as {_CALL_FORM} ({e}); "
            "give it four positional parameters, e.g. "
            "def score(prompt, response, reference, row) -> float | None"
        ) from None


def load_reward_function(
    spec: str,
    *,
    name: str | None = None,
    default_reward: float = 0.0,
    num_threads: int = 1,
) -> RewardFunction:
    """The RewardFunction at `spec`: "module:attr" (imported) or "path/to/file.py:attr" (run
    as a module of its own, once per process). `attr` may be dotted ("module:obj.method").

    Named `spec` ("my_module:score"; a file's stem for a path, "rewards:score") unless `name` is
    given. Every problem (no such module or file, the module fails to import, no such
    attribute, not callable, a wrong signature) is a ValueError that says what to fix.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"reward function {spec!r}: write {_SPEC_FORMS}")
    # The last colon: a Windows path has one of its own ("C:\\rewards.py:score").
    source, attr = spec.rsplit(":", 1)
    if not source or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"reward function {spec!r}: write {_SPEC_FORMS}")
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
    return RewardFunction(
        fn, name=name or default_name, default_reward=default_reward, num_threads=num_threads
    )


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
    except Exception as e:
        raise ValueError(
            f"reward function {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}"
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
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(
            f"reward function {spec!r}: running {path} failed: {type(e).__name__}: {e}"
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
