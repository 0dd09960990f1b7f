"""Plain Python reward functions, scored like a judge.

    def score(prompt: str, response: str, reference: str | None, row: dict) -> float | None: ...

    fn = load_reward_function("my_module:score")    # or "path/to/rewards.py:score"
    fn.score(samples)                               # verdicts, as GenRM.score gives
    CombinedRM(None, [(fn, 1.0), (load_reward_function("my_module:fmt"), 0.2)])  # no judge
    load_reward_function("rewards.py:score", timeout_s=10.0)  # in a worker process, killable

`row` is the sample's data row (`Sample.metadata`); treat it as read-only. What a call returns
becomes the verdict's status:

    a number within float32's range (a bool counts as 0/1)   -> "ok", that reward
    None ("cannot score this sample")                        -> "unparsable", `default_reward`
    raises, returns a str, NaN, inf, 1e39, or outlives timeout_s -> "error", `default_reward`,
                                                                `error` is the cause

so `ScoreStats` counts unscorable samples with the judge's unparsable ones and failures with the
judge's errors, and a broken function never stops a run. The signature is checked when the
function is loaded, not at the first sample. A reward file or module is code: loading it runs
it, with the trainer's permissions.

With `timeout_s`, calls run in worker processes (`_function_worker`): a call that outlives it is
an error verdict, its worker is killed and the next call starts a new one. Without it, calls run
in this process (no start-up, no pickling) and a hung call hangs the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import pickle
import queue
import sys
from collections.abc import Callable, Sequence
from typing import Any

from yatt.genrm._function_worker import FunctionWorker, describe_raise, resolve_function
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer, per_sample_batching
from yatt.genrm._types import Sample, Verdict
from yatt.genrm._verifiers import InvalidRewardError, check_reward
from yatt.genrm._votes import FailureLog

RewardFn = Callable[[str, str, str | None, dict[str, Any]], float | None]

_CALL_FORM = "fn(prompt, response, reference, row)"
# The trainer holds rewards in float32 tensors: a larger magnitude becomes inf there.
FLOAT32_MAX = 3.4028234663852886e38


def check_float32_reward(reward: float | None) -> float | None:
    """`reward`, or InvalidRewardError when float32 cannot hold it."""
    if reward is not None and abs(reward) > FLOAT32_MAX:
        raise InvalidRewardError(
            f"returned {reward!r}, beyond float32's range (|reward| <= {FLOAT32_MAX:.3g}) that "
            "the trainer's tensors hold; scale it down"
        )
    return reward


class RewardFunction(StreamingScorer):
    """A scorer (score / submit / finish / results / ascore, as GenRM) that calls
    `fn(prompt, response, reference, row)` for each sample; also a rule for `CombinedRM`.

    Streaming calls `fn` on `num_threads` worker threads (default 1: `fn` need not be
    thread-safe), never on the event loop, so a slow function does not stall a rollout stream
    running beside it.

    `timeout_s` (None: no limit): each call runs in a worker process (one per thread, started
    at the first call and kept), and a call that outlives `timeout_s` seconds is an "error"
    verdict saying so; its worker is killed and replaced. The worker loads `fn` by the spec
    `load_reward_function` was given, or else unpickles it, so a function given here directly
    must be defined at the top level of an importable module (not a lambda, not in __main__).
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        name: str | None = None,
        default_reward: float = 0.0,
        num_threads: int = 1,
        batching: BatchingConfig | None = None,
        timeout_s: float | None = None,
        _spec: str | None = None,  # set by load_reward_function: where a worker loads fn from
    ) -> None:
        if name is None:
            name = getattr(fn, "__qualname__", None) or type(fn).__name__
        if not isinstance(name, str) or not name or name == "judge":
            raise ValueError(f"name={name!r}: must be a non-empty str other than 'judge'")
        check_reward_function(fn, name)
        if not (math.isfinite(default_reward) and abs(default_reward) <= FLOAT32_MAX):
            raise ValueError(f"default_reward={default_reward!r}: must be finite (float32)")
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1")
        is_number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if timeout_s is not None and not (is_number and 0 < timeout_s < math.inf):
            raise ValueError(
                f"timeout_s={timeout_s!r}: seconds a call may take (> 0), or None for no limit"
            )
        # Each sample is scored on its own; num_threads bounds how many at once.
        super().__init__(
            batching=batching or per_sample_batching(),
            error_reward=default_reward,
        )
        self.fn = fn
        self.name = name
        self.default_reward = default_reward
        self.timeout_s = timeout_s
        self.metrics.update(num_timeouts=0)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="yatt-genrm-reward"
        )
        self._error_log = FailureLog("rule failure")
        # One worker process per thread that may call at once; started at its first call.
        self._workers: list[FunctionWorker] = []
        self._idle_workers: queue.SimpleQueue[FunctionWorker] = queue.SimpleQueue()
        if timeout_s is not None:
            target = _worker_target(fn, name, _spec)
            self._workers = [FunctionWorker(target) for _ in range(num_threads)]
            for worker in self._workers:
                self._idle_workers.put(worker)

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r})"

    def verify(self, sample: Sample) -> float | None:
        """`fn`'s reward for `sample`; raises what `fn` raises (with `timeout_s`: a
        RuntimeError with the cause), InvalidRewardError (a ValueError) when it returns
        something other than a number within float32's range, or None."""
        if self.timeout_s is not None:
            ((reward, cause),) = self.call_batch([sample])
            if cause is not None:
                raise RuntimeError(cause)
            return reward
        value = self.fn(sample.prompt, sample.response, sample.reference, sample.metadata)
        return check_float32_reward(check_reward(value))

    def call_batch(self, samples: Sequence[Sample]) -> list[tuple[float | None, str | None]]:
        """Per sample: (reward or None, None), or (None, the cause) when `fn` failed. Never
        raises (but Ctrl-C). With `timeout_s`, all of `samples` go to a worker in one message."""
        if self.timeout_s is None:
            return [self._call_here(sample) for sample in samples]
        return self._call_in_worker(samples, self.timeout_s)

    def _call_here(self, sample: Sample) -> tuple[float | None, str | None]:
        try:
            return self.verify(sample), None
        except InvalidRewardError as e:
            return None, f"{self.name} {e}"
        except (Exception, SystemExit) as e:  # sys.exit() in a function is its failure
            return None, f"{self.name} raised {describe_raise(e)}"

    def _call_in_worker(
        self, samples: Sequence[Sample], timeout_s: float
    ) -> list[tuple[float | None, str | None]]:
        results: list[tuple[float | None, str | None]] = [(None, None)] * len(samples)
        rows: list[bytes] = []
        sent: list[int] = []  # the index in `samples` of each row sent
        for i, sample in enumerate(samples):
            try:
                row = (sample.prompt, sample.response, sample.reference, sample.metadata)
                rows.append(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL))
                sent.append(i)
            except Exception as e:
                cause = f"its row cannot be sent to a worker process (pickle: {describe_raise(e)})"
                results[i] = (None, f"{self.name}: {cause}")
        if not rows:
            return results
        worker = self._idle_workers.get()
        try:
            replies = worker.call(rows, timeout_s)
        finally:
            self._idle_workers.put(worker)
        for i, (kind, payload) in zip(sent, replies, strict=True):
            results[i] = self._result_of(kind, payload)
        return results

    def _result_of(self, kind: str, payload: Any) -> tuple[float | None, str | None]:
        """A worker's reply as (reward, cause), with causes worded as for a call in-process."""
        if kind == "value":
            try:
                return check_float32_reward(check_reward(payload)), None
            except InvalidRewardError as e:
                return None, f"{self.name} {e}"
        if kind == "not_a_number":
            return None, (
                f"{self.name} returned {payload}; return a finite number, or None when the "
                "sample cannot be scored"
            )
        if kind == "raised":
            return None, f"{self.name} raised {payload}"
        if kind == "timeout":
            self.metrics["num_timeouts"] += 1
            return None, (
                f"{self.name} took over timeout_s={self.timeout_s:g} s; its worker process was "
                "killed (the next call starts a new one)"
            )
        if kind == "died":
            return None, f"{self.name}'s worker process {payload} while scoring this sample"
        return None, f"{self.name} cannot run in a worker process: {payload}"

    def _verdict(self, sample: Sample, result: tuple[float | None, str | None]) -> Verdict:
        reward, cause = result
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
        """Verdicts in order, computed on the calling thread (with `timeout_s`: by one
        worker process, all samples sent at once)."""
        results = self.call_batch(samples)
        verdicts = [self._verdict(s, r) for s, r in zip(samples, results, strict=True)]
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    def _score_one(self, sample: Sample) -> Verdict:
        return self._verdict(sample, self.call_batch([sample])[0])

    async def _judge_batch(self, items: list[Item]) -> None:
        loop = asyncio.get_running_loop()

        async def score_one(item: Item) -> None:
            item.resolve(await loop.run_in_executor(self._pool, self._score_one, item.sample))

        await asyncio.gather(*(score_one(item) for item in items))

    def close(self) -> None:
        """Stop the worker threads (a call in progress finishes) and kill the worker processes
        (a call in progress in one ends as an error)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.close()

    async def aclose(self) -> None:
        await super().aclose()
        self.close()


def _worker_target(fn: object, name: str, spec: str | None) -> tuple[str, Any]:
    """How a worker process gets `fn`: ("spec", spec) to load it as the parent did, or
    ("pickle", bytes) for a function pickled by reference; ValueError when it cannot be."""
    if spec is not None:
        return "spec", spec
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    qualname = getattr(fn, "__qualname__", "")
    file = getattr(module, "__file__", None)
    # A function of a file loaded by load_reward_function: its module name is ours, not
    # importable elsewhere, so the worker loads the file.
    is_ours = module is not None and module.__name__.startswith("yatt_reward_")
    if is_ours and file and "<locals>" not in qualname:
        return "spec", f"{file}:{qualname}"
    why = "it is defined in __main__" if getattr(fn, "__module__", None) == "__main__" else ""
    if not why:
        try:
            return "pickle", pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            why = f"it cannot be pickled ({type(e).__name__}: {e})"
    raise ValueError(
        f"reward function {name!r} with timeout_s runs in a worker process, but {why}; define "
        "it at the top level of a module and load it with load_reward_function('module:fn', "
        "timeout_s=...) or 'path/to/rewards.py:fn'"
    )


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
    timeout_s: float | None = None,
) -> RewardFunction:
    """The RewardFunction at `spec`: "module:attr" (imported) or "path/to/file.py:attr" (run
    as a module of its own, once per process). `attr` may be dotted ("module:obj.method").
    Loading runs the module's code here; with `timeout_s` (seconds per call, None: no limit)
    each worker process loads `spec` again and runs the calls.

    Named `spec` ("my_module:score"; a file's stem for a path, "rewards:score") unless `name` is
    given. Every problem (no such module or file, the module fails to import or calls
    sys.exit(), no such attribute, not callable, a wrong signature) is a ValueError that says
    what to fix.
    """
    fn, default_name = resolve_function(spec)
    return RewardFunction(
        fn,
        name=name or default_name,
        default_reward=default_reward,
        num_threads=num_threads,
        timeout_s=timeout_s,
        _spec=spec,
    )
