"""Rules beside the judge, or instead of it: a weighted sum, or rules that gate the judge.

    mode "sum":  reward = judge_weight * judge + sum_i weight_i * rule_i   (a None rule adds 0)
    mode "gate": any rule fails (0.0) -> gate_reward, and the judge is never called;
                 otherwise (all pass, or cannot decide) -> the judge's verdict.
    judge None:  reward = sum_i weight_i * rule_i, no judge model at all ("sum" only); status
                 "unparsable" (reward `default_reward`) when every rule returned None.

A rule is an `ExactMatch`-like verifier or a `RewardFunction` (plain Python). A rule that raises
or returns something other than a number within float32's range adds 0 and makes the verdict's
status "error", with the cause in `error` (so `ScoreStats` counts it with the judge's errors);
the run goes on. A weighted sum beyond float32's range is an "error" verdict with
`default_reward` too. Weights are checked up front: finite, and their absolute sum within
float32's range (rewards of magnitude 1 cannot overflow). Rules never run on the event loop:
a `RewardFunction` runs its calls concurrently on its pool, other rules on one worker thread.
Metrics a reward function returns (a dict's other keys) are carried on Verdict.metrics.

Gating saves judge work on answers a rule already rejects. `CombinedRM` has the interface of the
judge it wraps (score, submit/finish/results, ascore), so the trainer does not care which it has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from yatt.genrm._functions import (
    FLOAT32_MAX,
    RewardFunction,
    RewardOutcome,
    check_float32_reward,
)
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer
from yatt.genrm._types import Sample, Scorer, Verdict
from yatt.genrm._verifiers import InvalidRewardError, RuleVerifier, call_rule
from yatt.genrm._votes import FailureLog

CombineMode = Literal["sum", "gate"]


@dataclasses.dataclass(frozen=True)
class _Checked:
    """The rules' results for one sample: a value (or None) per rule, and what failed."""

    values: dict[str, float | None]
    causes: list[str]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    skip_causes: list[str] = dataclasses.field(default_factory=list)


class CombinedRM(StreamingScorer):
    """A judge (GenRM, GenRMClient, OpenAIJudge, or None for rules only) combined with rules.

    `rules` are (verifier, weight) pairs; names must be unique. `default_reward` (default: the
    judge's) is the reward when no rule could score a sample and there is no judge, and of a
    verdict made when scoring failed outright."""

    def __init__(
        self,
        judge: Scorer | None,
        rules: Sequence[tuple[RuleVerifier, float]],
        *,
        mode: CombineMode = "sum",
        judge_weight: float = 1.0,
        gate_reward: float = 0.0,
        default_reward: float | None = None,
    ) -> None:
        if judge is not None:
            for method in ("score", "ascore"):
                if not callable(getattr(judge, method, None)):
                    raise ValueError(
                        f"judge={judge!r} has no {method}(); pass a GenRM, GenRMClient, "
                        "OpenAIJudge, or None for rules only"
                    )
        if mode not in ("sum", "gate"):
            raise ValueError(f"mode={mode!r}: use 'sum' or 'gate'")
        if judge is None and mode == "gate":
            raise ValueError("mode='gate' gates a judge; with judge=None use mode='sum'")
        if not rules:
            raise ValueError("rules is empty: give at least one (verifier, weight) pair")
        for index, pair in enumerate(rules):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"rules: {pair!r} is not a (verifier, weight) pair")
            rule, weight = pair
            if not callable(getattr(rule, "verify", None)):
                raise ValueError(f"rules[{index}]: {rule!r} is not a verifier (no verify())")
            is_number = isinstance(weight, int | float) and not isinstance(weight, bool)
            if not (is_number and math.isfinite(weight) and abs(weight) <= FLOAT32_MAX):
                raise ValueError(
                    f"rules[{index}] ({getattr(rule, 'name', rule)!r}) weight={weight!r}: need a "
                    f"finite weight within float32's range (|weight| <= {FLOAT32_MAX:.3g})"
                )
        names = [rule.name for rule, _ in rules]
        if len(set(names)) != len(names) or "judge" in names:
            raise ValueError(
                f"rule names {names} must be unique and not 'judge' "
                "(load_reward_function(spec, name=...) renames one)"
            )
        if default_reward is None:
            default_reward = getattr(judge, "default_reward", 0.0)
        for name, value in (
            ("judge_weight", judge_weight),
            ("gate_reward", gate_reward),
            ("default_reward", default_reward),
        ):
            if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise ValueError(f"{name}={value!r}: must be finite, within float32's range")
        # Rewards of magnitude 1 from every rule (and the judge) must not overflow float32.
        weights = [(f"rules[{i}] ({rule.name!r})", w) for i, (rule, w) in enumerate(rules)]
        if judge is not None and mode == "sum":
            weights.append(("judge_weight", judge_weight))
        if math.fsum(abs(w) for _, w in weights) > FLOAT32_MAX:
            largest, weight = max(weights, key=lambda pair: abs(pair[1]))
            raise ValueError(
                f"the weights' absolute sum is over float32's max {FLOAT32_MAX:.3g}, so a reward "
                f"of 1 from each would overflow the trainer's float32 rewards; the largest is "
                f"{largest} weight={weight!r}: scale the weights down"
            )
        inner = getattr(judge, "batching", None) or BatchingConfig()
        # No window of our own: the judge batches; we only hand samples over as they come.
        batching = dataclasses.replace(
            inner, batch_window_millis=0.0, max_inflight_batches=inner.max_pending
        )
        super().__init__(batching=batching, error_reward=default_reward)
        self.judge = judge
        self.rules = list(rules)
        self.mode: CombineMode = mode
        self.judge_weight = judge_weight
        self.gate_reward = gate_reward
        self.default_reward = default_reward
        self.metrics.update(num_gated=0, num_rule_errors=0)
        # Rules run here while streaming: one thread, so a rule need not be thread-safe, and a
        # slow one (a reward function running code) does not stall the event loop.
        self._rule_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="yatt-genrm-rules"
        )
        self._error_log = FailureLog("rule failure")

    def _check_all(self, samples: Sequence[Sample]) -> list[_Checked]:
        """Every rule on every sample; a RewardFunction's calls run concurrently."""
        checks = [_Checked({}, []) for _ in samples]
        for rule, _ in self.rules:
            if isinstance(rule, RewardFunction):
                outcomes = rule.call_batch(samples)
            else:
                outcomes = [_call_in_range(rule, sample) for sample in samples]
            self._add_outcomes(rule.name, samples, checks, outcomes)
        return checks

    async def _acheck_all(self, samples: Sequence[Sample]) -> list[_Checked]:
        """`_check_all` off the event loop: reward functions on their pools, all at once;
        other rules (cheap checks) on the rule thread."""
        loop = asyncio.get_running_loop()
        checks = [_Checked({}, []) for _ in samples]

        async def run(rule: Any) -> list[RewardOutcome]:
            if isinstance(rule, RewardFunction):
                return await rule.acall_batch(samples)
            return await loop.run_in_executor(
                self._rule_pool, lambda: [_call_in_range(rule, s) for s in samples]
            )

        outcomes = await asyncio.gather(*(run(rule) for rule, _ in self.rules))
        for (rule, _), rule_outcomes in zip(self.rules, outcomes, strict=True):
            self._add_outcomes(rule.name, samples, checks, rule_outcomes)
        return checks

    def _add_outcomes(
        self,
        name: str,
        samples: Sequence[Sample],
        checks: list[_Checked],
        outcomes: Sequence[RewardOutcome],
    ) -> None:
        for sample, checked, outcome in zip(samples, checks, outcomes, strict=True):
            checked.values[name] = outcome.reward
            checked.metrics.update(outcome.metrics)
            if outcome.skip_cause is not None:
                checked.skip_causes.append(outcome.skip_cause)
            if outcome.cause is not None:
                checked.causes.append(outcome.cause)
                self._error_log.record(sample.id, outcome.cause)

    def _is_gated(self, checked: _Checked) -> bool:
        return self.mode == "gate" and any(v == 0.0 for v in checked.values.values())

    def _rule_sum(self, checked: _Checked) -> float:
        return math.fsum(w * (checked.values[rule.name] or 0.0) for rule, w in self.rules)

    def _with_causes(self, verdict: Verdict, checked: _Checked) -> Verdict:
        """`verdict`, made an error naming the rules that failed, if any did, or with
        `default_reward` when its weighted sum is beyond float32's range."""
        if abs(verdict.reward) > FLOAT32_MAX:
            cause = (
                f"the weighted reward {verdict.reward!r} is beyond float32's range "
                f"(components {verdict.components}); scale the rewards or weights down"
            )
            self._error_log.record(verdict.sample_id, cause)
            verdict = dataclasses.replace(
                verdict,
                reward=self.default_reward,
                status="error",
                error="; ".join([verdict.error, cause]) if verdict.error else cause,
            )
        if checked.metrics:
            verdict = dataclasses.replace(verdict, metrics={**verdict.metrics, **checked.metrics})
        if not checked.causes:
            return verdict
        self.metrics["num_rule_errors"] += len(checked.causes)
        error = "; ".join([verdict.error, *checked.causes] if verdict.error else checked.causes)
        skip_cause = verdict.skip_cause or (checked.skip_causes[0] if checked.skip_causes else None)
        return dataclasses.replace(verdict, status="error", error=error, skip_cause=skip_cause)

    def _gated(self, sample: Sample, checked: _Checked) -> Verdict:
        self.metrics["num_gated"] += 1
        verdict = Verdict(
            sample_id=sample.id,
            reward=self.gate_reward,
            status="ok",
            components={**checked.values, "judge": None},
        )
        return self._with_causes(verdict, checked)

    def _rules_only(self, sample: Sample, checked: _Checked) -> Verdict:
        if any(value is not None for value in checked.values.values()):
            verdict = Verdict(
                sample_id=sample.id,
                reward=self._rule_sum(checked),
                status="ok",
                components=dict(checked.values),
            )
        else:
            verdict = Verdict(
                sample_id=sample.id,
                reward=self.default_reward,
                status="unparsable",
                error=None if checked.causes else "every rule returned None (cannot score)",
                components=dict(checked.values),
            )
        return self._with_causes(verdict, checked)

    def _combine(self, verdict: Verdict, checked: _Checked) -> Verdict:
        components = {**checked.values, "judge": verdict.reward if verdict.status == "ok" else None}
        if self.mode == "gate":
            combined = dataclasses.replace(verdict, components=components)
        else:
            reward = self.judge_weight * verdict.reward + self._rule_sum(checked)
            combined = dataclasses.replace(verdict, reward=reward, components=components)
        return self._with_causes(combined, checked)

    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        """Verdicts in order; gated samples never reach the judge.

        `should_stop` (None: not read): polled while the rules and the judge are awaited; once
        it returns True the reward functions' worker calls are killed, the judge's pending
        requests aborted and ScoringStopped raised, no verdicts."""
        if should_stop is not None:
            return self._score_until_stopped(samples, should_stop)
        checks = self._check_all(samples)
        judged: list[Verdict] = []
        if self.judge is not None:
            judged = self.judge.score([samples[i] for i in self._to_judge(checks)])
        return self._settle(samples, checks, judged)

    async def _ascore_all(self, samples: Sequence[Sample]) -> list[Verdict]:
        # As score(): the rules over the whole batch, then the judge on what they let through.
        checks = await self._acheck_all(samples)
        judged: list[Verdict] = []
        if self.judge is not None:
            judged = await self.judge.ascore([samples[i] for i in self._to_judge(checks)])
        return self._settle(samples, checks, judged)

    def _to_judge(self, checks: Sequence[_Checked]) -> list[int]:
        return [i for i, c in enumerate(checks) if not self._is_gated(c)]

    def _settle(
        self, samples: Sequence[Sample], checks: list[_Checked], judged: list[Verdict]
    ) -> list[Verdict]:
        """The combined verdicts (recorded) from the rules' results and the judge's verdicts
        of the samples `_to_judge` picked, in that order."""
        if self.judge is None:
            out = [self._rules_only(s, c) for s, c in zip(samples, checks, strict=True)]
        else:
            by_index = dict(zip(self._to_judge(checks), judged, strict=True))
            out = [
                self._combine(by_index[i], c) if i in by_index else self._gated(samples[i], c)
                for i, c in enumerate(checks)
            ]
        for v in out:
            self._record(v)
        return out

    async def _abort(self) -> None:
        """Also the rules' worker calls and the judge's pending requests."""
        await super()._abort()
        for rule, _ in self.rules:
            if isinstance(rule, RewardFunction):
                await rule._abort()
        judge_abort = getattr(self.judge, "_abort", None)
        if judge_abort is not None:
            await judge_abort()

    async def _judge_batch(self, items: list[Item]) -> None:
        async def judge_one(item: Item) -> None:
            (checked,) = await self._acheck_all([item.sample])
            if self.judge is None:
                item.resolve(self._rules_only(item.sample, checked))
                return
            if self._is_gated(checked):
                item.resolve(self._gated(item.sample, checked))
                return
            # One sample per ascore call: each resolves as soon as the judge has it, and the
            # judge's own batcher groups these concurrent calls into engine batches.
            (verdict,) = await self.judge.ascore([item.sample])
            item.resolve(self._combine(verdict, checked))

        await asyncio.gather(*(judge_one(item) for item in items))

    def close(self) -> None:
        """Stop the rule thread (the judge is closed by whoever made it, or by aclose)."""
        self._rule_pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        await super().aclose()
        if self.judge is not None:
            await self.judge.aclose()
        self.close()


def _call_in_range(rule: RuleVerifier, sample: Sample) -> RewardOutcome:
    """`call_rule`, with a value float32 cannot hold made a cause."""
    value, cause = call_rule(rule, sample)
    try:
        return RewardOutcome(check_float32_reward(value), cause)
    except InvalidRewardError as e:
        return RewardOutcome(None, f"{rule.name} {e}")
