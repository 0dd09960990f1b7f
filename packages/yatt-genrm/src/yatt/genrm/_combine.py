"""Rule verifiers beside the judge: a weighted sum, or rules that gate the judge.

    mode "sum":  reward = judge_weight * judge + sum_i weight_i * rule_i   (a None rule adds 0)
    mode "gate": any rule fails (0.0) -> gate_reward, and the judge is never called;
                 otherwise (all pass, or cannot decide) -> the judge's verdict.

Gating saves judge work on answers a rule already rejects. `CombinedRM` has the interface of the
judge it wraps (score, submit/finish/results, ascore), so the trainer does not care which it has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer
from yatt.genrm._types import Sample, Verdict
from yatt.genrm._verifiers import RuleVerifier

CombineMode = Literal["sum", "gate"]


class CombinedRM(StreamingScorer):
    """A judge (GenRM or GenRMClient) combined with rule verifiers."""

    def __init__(
        self,
        judge: Any,
        rules: Sequence[tuple[RuleVerifier, float]],
        *,
        mode: CombineMode = "sum",
        judge_weight: float = 1.0,
        gate_reward: float = 0.0,
    ) -> None:
        for method in ("score", "ascore"):
            if not callable(getattr(judge, method, None)):
                raise ValueError(f"judge={judge!r} has no {method}(); pass a GenRM or GenRMClient")
        if mode not in ("sum", "gate"):
            raise ValueError(f"mode={mode!r}: use 'sum' or 'gate'")
        if not rules:
            raise ValueError("rules is empty: give at least one (verifier, weight) pair")
        names = [rule.name for rule, _ in rules]
        if len(set(names)) != len(names) or "judge" in names:
            raise ValueError(f"rule names {names} must be unique and not 'judge'")
        for rule, weight in rules:
            if not callable(getattr(rule, "verify", None)) or not math.isfinite(weight):
                raise ValueError(
                    f"rule ({rule!r}, {weight!r}): need a verifier and a finite weight"
                )
        for name, value in (("judge_weight", judge_weight), ("gate_reward", gate_reward)):
            if not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: must be finite")
        inner = getattr(judge, "batching", None) or BatchingConfig()
        # No window of our own: the judge batches; we only hand samples over as they come.
        batching = dataclasses.replace(
            inner, batch_window_millis=0.0, max_inflight_batches=inner.max_pending
        )
        super().__init__(batching=batching, error_reward=getattr(judge, "default_reward", 0.0))
        self.judge = judge
        self.rules = list(rules)
        self.mode: CombineMode = mode
        self.judge_weight = judge_weight
        self.gate_reward = gate_reward
        self.metrics["num_gated"] = 0

    def _check(self, sample: Sample) -> dict[str, float | None]:
        return {rule.name: rule.verify(sample) for rule, _ in self.rules}

    def _is_gated(self, checks: dict[str, float | None]) -> bool:
        return self.mode == "gate" and any(v == 0.0 for v in checks.values())

    def _gated(self, sample: Sample, checks: dict[str, float | None]) -> Verdict:
        self.metrics["num_gated"] += 1
        return Verdict(
            sample_id=sample.id,
            reward=self.gate_reward,
            status="ok",
            components={**checks, "judge": None},
        )

    def _combine(self, verdict: Verdict, checks: dict[str, float | None]) -> Verdict:
        components = {**checks, "judge": verdict.reward if verdict.status == "ok" else None}
        if self.mode == "gate":
            return dataclasses.replace(verdict, components=components)
        reward = self.judge_weight * verdict.reward
        reward += math.fsum(w * (checks[rule.name] or 0.0) for rule, w in self.rules)
        return dataclasses.replace(verdict, reward=reward, components=components)

    def score(self, samples: Sequence[Sample]) -> list[Verdict]:
        """Verdicts in order; gated samples never reach the judge."""
        checks = [self._check(s) for s in samples]
        to_judge = [i for i, c in enumerate(checks) if not self._is_gated(c)]
        judged = dict(zip(to_judge, self.judge.score([samples[i] for i in to_judge]), strict=True))
        out = [
            self._combine(judged[i], c) if i in judged else self._gated(samples[i], c)
            for i, c in enumerate(checks)
        ]
        for v in out:
            self._record(v)
        return out

    async def _judge_batch(self, items: list[Item]) -> None:
        async def judge_one(item: Item) -> None:
            checks = self._check(item.sample)
            if self._is_gated(checks):
                item.resolve(self._gated(item.sample, checks))
                return
            # One sample per ascore call: each resolves as soon as the judge has it, and the
            # judge's own batcher groups these concurrent calls into engine batches.
            (verdict,) = await self.judge.ascore([item.sample])
            item.resolve(self._combine(verdict, checks))

        await asyncio.gather(*(judge_one(item) for item in items))

    async def aclose(self) -> None:
        await super().aclose()
        await self.judge.aclose()
