"""Plain Python reward functions, scored like a judge, in yatt's, TRL's or verl's form.

    def score(prompt, response, reference, row) -> float | dict | None: ...        # "sample"
    def reward(prompts, completions, **columns) -> list[float | None]: ...          # "trl"
    def compute_score(data_source, solution_str, ground_truth, extra_info): ...     # "verl"

    fn = load_reward_function("my_module:score")    # or "path/to/rewards.py:score"
    fn.score(samples)                               # verdicts, as GenRM.score gives
    load_reward_function("rewards.py:score", timeout_s=10.0)  # in worker processes, killable
    load_reward_functions(specs, weights=, forms=, timeout_s=, num_workers=)  # one shared pool

The form is given (`form=`) or found from the parameter names (`_reward_forms`), never from
their count. Functions may be async. Calls run concurrently (`num_threads` at once: worker
processes with `timeout_s`, threads without), so a 50 ms reward over 64 samples costs about
64 x 50 ms / num_threads, not 3.2 s. `row` is the sample's data row (`Sample.metadata`); treat it
as read-only. What a call returns becomes the verdict:

    a number within float32's range (a bool or numpy scalar counts)  -> "ok", that reward
    a dict {"score": number, **metrics} (verl)   -> "ok", the score; numeric metrics kept on
                                                    Verdict.metrics as "<name>/<key>"
    None ("cannot score this sample")            -> "unparsable", `default_reward`
    raises (any BaseException), returns a str, NaN, inf, 1e39, outlives timeout_s
                                                 -> "error", `default_reward`, `error` the cause
    its row cannot be sent to a worker process   -> "error" with `skip_cause` (a data skip)

so `ScoreStats` counts unscorable samples with the judge's unparsable ones and failures with the
judge's errors, and a broken function never stops a run. The signature is checked when the
function is loaded, not at the first sample. A reward file or module is code: loading it runs
it, with the trainer's permissions.

With `timeout_s`, calls run in `yatt.rollout.UserCodePool` worker processes: a call that
outlives it is an error verdict, its worker's whole process group is killed (programs it started
too) and the next call starts a new one. Without it, calls run in this process (no start-up, no
pickling) and a hung call hangs the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from yatt.genrm._reward_forms import (
    REWARD_FORMS,
    RewardForm,
    detect_form,
    sample_call,
    trl_call,
    verl_call,
)
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer, per_sample_batching
from yatt.genrm._types import Sample, Verdict
from yatt.genrm._verifiers import InvalidRewardError, as_python_scalar, check_reward
from yatt.genrm._votes import FailureLog
from yatt.rollout import UserCodePool, UserCodeResult

RewardFn = Callable[..., Any]

# The trainer holds rewards in float32 tensors: a larger magnitude becomes inf there.
FLOAT32_MAX = 3.4028234663852886e38
# TRL-form calls in a stream: samples gathered for one call (TRL calls once per batch).
_TRL_BATCHING = BatchingConfig(
    max_batch_size=64, batch_window_millis=20.0, max_inflight_batches=256
)


def check_float32_reward(reward: float | None) -> float | None:
    """`reward`, or InvalidRewardError when float32 cannot hold it."""
    if reward is not None and abs(reward) > FLOAT32_MAX:
        raise InvalidRewardError(
            f"returned {reward!r}, beyond float32's range (|reward| <= {FLOAT32_MAX:.3g}) that "
            "the trainer's tensors hold; scale it down"
        )
    return reward


@dataclasses.dataclass(frozen=True)
class RewardOutcome:
    """One sample's result from a reward function: a reward (None: cannot score), or a cause;
    named metrics from a dict return; `skip_cause` when the row itself could not be sent."""

    reward: float | None
    cause: str | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    skip_cause: str | None = None


def read_reward(value: object) -> tuple[float | None, dict[str, float]]:
    """(reward, metrics) from what a function returned: a number, None, or a dict with a
    "score" key (its other numeric values are metrics; other values are left out).
    InvalidRewardError saying what to return otherwise."""
    if isinstance(value, dict):
        if "score" not in value:
            raise InvalidRewardError(
                f"returned a dict without a 'score' key (keys {sorted(map(str, value))[:8]}); "
                "return {'score': reward, **metrics} or a number"
            )
        metrics: dict[str, float] = {}
        for key, metric in value.items():
            metric = as_python_scalar(metric)
            is_number = isinstance(metric, int | float)
            if key != "score" and is_number and math.isfinite(metric):
                metrics[str(key)] = float(metric)
        return check_float32_reward(check_reward(value["score"])), metrics
    return check_float32_reward(check_reward(value)), {}


class _PoolLease:
    """A pool shared by several functions: closed when the last of them closes; replaced by a
    fresh one (same settings, workers started at first need) when a stop kills its calls."""

    def __init__(self, num_users: int, **pool_options: Any) -> None:
        self._pool_options = pool_options
        self.pool = UserCodePool(**pool_options)
        self._num_users = num_users
        self._lock = threading.Lock()
        self._retired: list[UserCodePool] = []  # replaced pools: their counts still add up

    def release(self) -> None:
        with self._lock:
            self._num_users -= 1
            is_last = self._num_users == 0
        if is_last:
            self.pool.close()

    def kill_calls(self) -> None:
        """End every call in flight: its worker processes are killed whole (a call waiting on
        one ends as an error) and later calls go to a fresh pool. UserCodePool has no
        per-call cancel, and a stopped step's calls are all of the pool's."""
        with self._lock:
            if self._num_users <= 0:
                return
            old, self.pool = self.pool, UserCodePool(**self._pool_options)
            self._retired.append(old)
        old.close()

    def stats(self) -> dict[str, int]:
        """The pool's counts, the replaced pools' included (a killed call is counted by its
        pool once its thread sees the worker die)."""
        stats = self.pool.stats()
        for old in self._retired:
            for key, count in old.stats().items():
                stats[key] = stats.get(key, 0) + count
        return stats


class RewardFunction(StreamingScorer):
    """A scorer (score / submit / finish / results / ascore, as GenRM) that calls `fn` in its
    form for each sample (each batch, for the TRL form); also a rule for `CombinedRM`.

    `num_threads`: calls at once (None: 1 in process, so `fn` need not be thread-safe; with
    `timeout_s`, the CPUs this process may use, at most 8). Calls never run on the event loop.

    `timeout_s` (None: no limit, calls in this process): each call runs in a worker process
    (started at first need and kept), and a call that outlives `timeout_s` seconds is an
    "error" verdict saying so; its worker's process group is killed and replaced. The worker
    loads `fn` by the spec `load_reward_function` was given, or else unpickles it, so a function
    given here directly must be defined at the top level of an importable module."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        name: str | None = None,
        default_reward: float = 0.0,
        num_threads: int | None = None,
        batching: BatchingConfig | None = None,
        timeout_s: float | None = None,
        form: str = "auto",
        max_reply_bytes: int = UserCodePool.DEFAULT_MAX_REPLY_BYTES,
        _spec: str | None = None,  # set by load_reward_function: where a worker loads fn from
        _lease: _PoolLease | None = None,  # set by load_reward_functions: a shared pool
    ) -> None:
        if name is None:
            name = getattr(fn, "__qualname__", None) or type(fn).__name__
        if not isinstance(name, str) or not name or name == "judge":
            raise ValueError(f"name={name!r}: must be a non-empty str other than 'judge'")
        self.form: RewardForm = check_reward_function(fn, name, form)
        if not (math.isfinite(default_reward) and abs(default_reward) <= FLOAT32_MAX):
            raise ValueError(f"default_reward={default_reward!r}: must be finite (float32)")
        if timeout_s is not None:
            UserCodePool.check_timeout_s("timeout_s", timeout_s)
        if num_threads is None:
            num_threads = 1 if timeout_s is None else UserCodePool.default_num_workers()
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1")
        if batching is None:
            batching = _TRL_BATCHING if self.form == "trl" else per_sample_batching()
        super().__init__(batching=batching, error_reward=default_reward)
        self.fn = fn
        self.name = name
        self.default_reward = default_reward
        self.metrics.update(num_timeouts=0, num_data_skips=0)
        self._error_log = FailureLog("rule failure")
        if _lease is None:
            _lease = _PoolLease(
                1,
                num_workers=num_threads,
                timeout_s=timeout_s,
                max_reply_bytes=max_reply_bytes,
                in_process=timeout_s is None,
                name=f"reward function {name!r}",
            )
        self._lease = _lease
        self.timeout_s = self._pool.timeout_s
        self._is_closed = False
        # A worker loads a loaded file's function by its spec, anything else by reference.
        self._target: Any = _spec if (_spec is not None and timeout_s is not None) else fn
        why = self._pool.cannot_send(self._target)
        if why is not None:
            self._lease.release()
            raise ValueError(
                f"reward function {name!r} with timeout_s runs in a worker process, but {why}; "
                "define it at the top level of a module and load it with "
                "load_reward_function('module:fn', timeout_s=...) or 'path/to/rewards.py:fn'"
            )

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r})"

    @property
    def _pool(self) -> UserCodePool:
        return self._lease.pool  # replaced after a stop killed its calls

    # -- calling --------------------------------------------------------------------------
    def _calls(self, samples: Sequence[Sample]) -> list[tuple[list[int], tuple, dict]]:
        """(the indices of `samples` one call scores, args, kwargs) per call."""
        if self.form == "trl":
            return [(list(range(len(samples))), *trl_call(samples))] if samples else []
        if self.form == "verl":
            return [([i], *verl_call(self.fn, s)) for i, s in enumerate(samples)]
        return [([i], *sample_call(s)) for i, s in enumerate(samples)]

    def _outcomes(
        self, indices: list[int], result: UserCodeResult, outcomes: list[RewardOutcome | None]
    ) -> None:
        """Fills `outcomes` at `indices` from one call's result."""
        if not result.is_ok:
            cause = self._cause_of(result)
            skip = cause if result.status == "bad_input" else None
            if skip is not None:
                self.metrics["num_data_skips"] += len(indices)
            for i in indices:
                outcomes[i] = RewardOutcome(None, cause, skip_cause=skip)
            return
        if self.form != "trl":
            (i,) = indices
            outcomes[i] = self._outcome_of(result.value)
            return
        values = result.value
        if not isinstance(values, list | tuple) or len(values) != len(indices):
            what = f"a {type(values).__name__}"
            if isinstance(values, list | tuple):
                what += f" of {len(values)}"
            cause = (
                f"{self.name} returned {what} for a batch of {len(indices)} samples; a TRL-form "
                "reward function returns a list with one reward (or None) per completion"
            )
            for i in indices:
                outcomes[i] = RewardOutcome(None, cause)
            return
        for i, value in zip(indices, values, strict=True):
            outcomes[i] = self._outcome_of(value)

    def _outcome_of(self, value: object) -> RewardOutcome:
        try:
            reward, metrics = read_reward(value)
        except InvalidRewardError as e:
            return RewardOutcome(None, f"{self.name} {e}")
        return RewardOutcome(reward, metrics={f"{self.name}/{k}": v for k, v in metrics.items()})

    def _cause_of(self, result: UserCodeResult) -> str:
        cause = result.cause or result.status
        if result.status == "timeout":
            self.metrics["num_timeouts"] += 1
            return (
                f"{self.name} took over timeout_s={self.timeout_s:g} s; its worker process "
                "group was killed (the next call starts a new one)"
            )
        if cause.startswith("raised "):
            return f"{self.name} {cause}"
        return f"{self.name}: {cause}"

    def call_batch(self, samples: Sequence[Sample]) -> list[RewardOutcome]:
        """One outcome per sample, calls run concurrently. Never raises (but Ctrl-C)."""
        outcomes: list[RewardOutcome | None] = [None] * len(samples)
        calls = self._calls(samples)
        if len(calls) == 1:  # on this thread: a Ctrl-C while it waits reaches the caller
            indices, args, kwargs = calls[0]
            self._outcomes(indices, self._pool.call_sync(self._target, *args, **kwargs), outcomes)
        elif calls:
            results = self._pool.call_many_sync([(self._target, a, k) for _, a, k in calls])
            for (indices, _, _), result in zip(calls, results, strict=True):
                self._outcomes(indices, result, outcomes)
        return outcomes  # type: ignore[return-value]

    async def acall_batch(self, samples: Sequence[Sample]) -> list[RewardOutcome]:
        """`call_batch` without blocking the event loop."""
        outcomes: list[RewardOutcome | None] = [None] * len(samples)
        calls = self._calls(samples)
        results = await asyncio.gather(
            *(self._pool.call(self._target, *args, **kwargs) for _, args, kwargs in calls)
        )
        for (indices, _, _), result in zip(calls, results, strict=True):
            self._outcomes(indices, result, outcomes)
        return outcomes  # type: ignore[return-value]

    def verify(self, sample: Sample) -> float | None:
        """`fn`'s reward for `sample` (a RuleVerifier); raises RuntimeError with the cause when
        the call failed, InvalidRewardError (a ValueError) when it returned a non-number."""
        (outcome,) = self.call_batch([sample])
        if outcome.cause is not None:
            if " returned " in outcome.cause:
                raise InvalidRewardError(outcome.cause.split(" ", 1)[1])
            raise RuntimeError(outcome.cause)
        return outcome.reward

    # -- verdicts -------------------------------------------------------------------------
    def _verdict(self, sample: Sample, outcome: RewardOutcome) -> Verdict:
        components = {self.name: outcome.reward}
        if outcome.cause is not None:
            self._error_log.record(sample.id, outcome.cause)
            return Verdict(
                sample_id=sample.id,
                reward=self.default_reward,
                status="error",
                error=outcome.cause,
                components=components,
                skip_cause=outcome.skip_cause,
            )
        if outcome.reward is None:
            return Verdict(
                sample_id=sample.id,
                reward=self.default_reward,
                status="unparsable",
                error=f"{self.name} returned None (cannot score this sample)",
                components=components,
                metrics=outcome.metrics,
            )
        return Verdict(
            sample_id=sample.id,
            reward=outcome.reward,
            status="ok",
            components=components,
            metrics=outcome.metrics,
        )

    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        """Verdicts in order; calls run concurrently (num_threads at once).

        `should_stop` (None: not read): polled while the calls are awaited; once it returns
        True the worker processes running them are killed whole (the next call starts fresh
        ones) and ScoringStopped is raised, no verdicts. In process (timeout_s None) a sync
        call cannot be killed: it runs on, unwaited, on its thread."""
        if should_stop is not None:
            return self._score_until_stopped(samples, should_stop)
        outcomes = self.call_batch(samples)
        verdicts = [self._verdict(s, o) for s, o in zip(samples, outcomes, strict=True)]
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    async def _ascore_all(self, samples: Sequence[Sample]) -> list[Verdict]:
        # As score(): one acall_batch over every sample (a TRL-form function sees one batch).
        outcomes = await self.acall_batch(samples)
        verdicts = [self._verdict(s, o) for s, o in zip(samples, outcomes, strict=True)]
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    async def _abort(self) -> None:
        """Also kill the worker processes of every call in flight on this function's pool
        (shared by the functions of one load_reward_functions call): those calls end as
        errors, the next call starts fresh workers."""
        await super()._abort()
        if not self._is_closed:
            self._lease.kill_calls()

    async def _judge_batch(self, items: list[Item]) -> None:
        samples = [item.sample for item in items]
        outcomes = await self.acall_batch(samples)
        for item, outcome in zip(items, outcomes, strict=True):
            item.resolve(self._verdict(item.sample, outcome))

    def pool_stats(self) -> dict[str, int]:
        """The worker pool's counts (calls, timeouts, worker starts, processes killed after
        their call, stray replies dropped); shared by the functions of one
        load_reward_functions call."""
        return self._lease.stats()

    def close(self) -> None:
        """Kill the worker processes (a call in progress in one ends as an error); a shared
        pool is closed by the last of its functions."""
        if not self._is_closed:
            self._is_closed = True
            self._lease.release()

    async def aclose(self) -> None:
        await super().aclose()
        self.close()


def check_reward_function(fn: object, name: str, form: str = "auto") -> RewardForm:
    """The form `fn` is called in; ValueError unless it is a callable that fits that form."""
    if inspect.isclass(fn):
        raise ValueError(
            f"reward function {name!r} is a class; point at a function, or make an instance "
            "in your module and point at it"
        )
    if not callable(fn):
        raise ValueError(
            f"reward function {name!r} is not callable (its type is {type(fn).__name__}); "
            "point at a function"
        )
    return detect_form(fn, name, form)


def load_reward_function(
    spec: str,
    *,
    name: str | None = None,
    default_reward: float = 0.0,
    num_threads: int | None = None,
    timeout_s: float | None = None,
    form: str = "auto",
) -> RewardFunction:
    """The RewardFunction at `spec`: "module:attr" (imported) or "path/to/file.py:attr" (run
    as a module of its own, once per process, its folder importable). `attr` may be dotted
    ("module:obj.method"). Loading runs the module's code here; with `timeout_s` (seconds per
    call, None: no limit) each worker process loads `spec` again and runs the calls.

    Named `spec` ("my_module:score"; a file's stem for a path, "rewards:score") unless `name` is
    given. Every problem (no such module or file, the module fails to import or calls
    sys.exit(), no such attribute, not callable, a signature that fits no form) is a ValueError
    that says what to fix.
    """
    fn, default_name = UserCodePool.resolve(spec, what="reward function")
    return RewardFunction(
        fn,
        name=name or default_name,
        default_reward=default_reward,
        num_threads=num_threads,
        timeout_s=timeout_s,
        form=form,
        _spec=spec,
    )


def load_reward_functions(
    specs: Sequence[str],
    *,
    weights: Sequence[float] | None = None,
    forms: Sequence[str] | None = None,
    timeout_s: float | None = None,
    num_workers: int | None = None,
    max_reply_bytes: int = UserCodePool.DEFAULT_MAX_REPLY_BYTES,
) -> list[tuple[RewardFunction, float]]:
    """Each function at `specs` with its weight (default 1.0), all sharing one pool of
    `num_workers` worker processes (None: the CPUs this process may use, at most 8), so several
    functions never oversubscribe the machine. `forms`: one per spec ("auto", "sample", "trl",
    "verl"; default "auto"). `timeout_s` None runs calls in this process, one at a time per
    function. Close each function (or aclose it); the pool goes with the last one."""
    specs = list(specs)
    weights = [1.0] * len(specs) if weights is None or not list(weights) else list(weights)
    forms = ["auto"] * len(specs) if forms is None or not list(forms) else list(forms)
    for field_name, values in (("weights", weights), ("forms", forms)):
        if len(values) != len(specs):
            raise ValueError(
                f"{field_name} has {len(values)} entries for {len(specs)} reward functions: "
                "give one per function, or none"
            )
    for i, form in enumerate(forms):
        if form not in REWARD_FORMS:
            raise ValueError(f"forms[{i}]={form!r}: use one of {REWARD_FORMS}")
    if not specs:
        return []
    loaded = [UserCodePool.resolve(spec, what="reward function") for spec in specs]
    if timeout_s is None:
        # In process: each function its own single thread (fn need not be thread-safe).
        return [
            (load_reward_function(spec, timeout_s=None, form=form), weight)
            for spec, form, weight in zip(specs, forms, weights, strict=True)
        ]
    lease = _PoolLease(
        len(specs),
        num_workers=num_workers if num_workers is not None else UserCodePool.default_num_workers(),
        timeout_s=timeout_s,
        max_reply_bytes=max_reply_bytes,
        name="reward functions",
    )
    functions: list[tuple[RewardFunction, float]] = []
    try:
        for spec, (fn, default_name), form, weight in zip(
            specs, loaded, forms, weights, strict=True
        ):
            function = RewardFunction(
                fn, name=default_name, timeout_s=timeout_s, form=form, _spec=spec, _lease=lease
            )
            functions.append((function, weight))
    except BaseException:
        lease.pool.close()
        raise
    return functions
