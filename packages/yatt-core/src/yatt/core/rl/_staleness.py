"""Off-policy steps with a staleness bound: the config, its checks, and admission control.

    rollout (engine at version w)                      trainer (at version v)
    ---------------------------------------------      ----------------------------------
    n = admission.num_admissible(version=w)            batch = P prompts' groups, as they
    admission.start(k <= n, version=w)  -> prompts       finish (not in start order)
    tokens stamped with w (and later versions when     update -> v + 1, weights pushed:
      weights arrive mid-generation)                   engine at w = v + 1

A policy version is the number of optimizer updates applied to the weights. The trainer takes
P prompts' groups per step (prompts_per_step). Counting every prompt ever started from 0, the
trainer at version v trains the prompts numbered v*P .. (v+1)*P - 1 by count. A prompt started
as number n under weights w is therefore trained at version floor(n / P) at the earliest, and
its age there is floor(n / P) - w. The bound age <= s holds for it exactly when

    n < (w + s + 1) * P                                                    (AReaL's rule:
                                                   arXiv:2505.24298, sec. 5.1, Fu et al. 2025)

so num_admissible(w) = (w + s + 1) * P - num_started. s = 0 is the on-policy step: the next
step's prompts start only once the weights of the step before them are in the engine.

Paced, not discarded: a prompt that was started stays in flight until it finishes, however
long its tail (tinker-cookbook #822: discarding stale groups starves the slow, hard prompts).
Its tokens carry their versions; if it finishes after its turn came it is trained a step later
and is older than s, which compute_staleness_metrics counts as tokens_over_bound. Admission
only ever refuses to START work that would be too old.

A prompt drawn but never trained (a group the dynamic sampler filtered out) gives its slot
back with release(), so filtering does not slow generation down.

The rule counts on every step training P prompts. A step that trains fewer (a batch left
unfilled, a step a stop signal ended: its version still moves) says so with
record_step(num_trained): the P - num_trained slots it did not consume are subtracted from the
limit for good (num_short_slots), so the prompts in flight, trained a step later than planned,
do not let new ones start further ahead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Placements whose judge engine sleeps while the rollout runs: each phase takes every GPU in
# turn, so a worker cannot judge the group it just generated.
_PHASED_PLACEMENTS = ("full",)
# Policy backends the off-policy driver was built and tested with (one controller per DP rank
# owning its weights' version); Megatron's TP/PP peers share one batch by broadcast, untested.
_STALENESS_POLICY_BACKENDS = ("torch",)


@dataclass(kw_only=True, frozen=True)
class StalenessConfig:
    """How far rollout may run ahead of training (issue 48)."""

    # s: the most policy versions a prompt's start may lag the step that trains it; 0 is
    # today's on-policy step (each step's rollout waits for the previous step's weights)
    max_staleness: int = 0

    def __post_init__(self) -> None:
        _check_max_staleness("StalenessConfig.max_staleness", self.max_staleness)

    @property
    def is_off_policy(self) -> bool:
        """Whether rollout runs ahead of training (max_staleness >= 1)."""
        return self.max_staleness >= 1


def _check_max_staleness(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{field}={value!r}: must be an int >= 0 (0: on-policy; 1 or 2: rollout runs that "
            "many policy versions ahead of training)"
        )


def check_staleness(
    *,
    max_staleness: int,
    rollout_correction: str,
    old_logprobs_from: str,
    placement: str,
    policy_backend: str,
    should_keep_partial: bool = False,
    sampling_mode: str = "rounds",
    has_judge_engine: bool = True,
    field: str = "rollout.max_staleness",
) -> None:
    """ValueError naming the field when an off-policy run cannot hold: a negative bound, no
    rollout correction, pi_old taken from the engine, a placement that puts the judge's engine
    (has_judge_engine: the reward runs a model of its own) to sleep while the rollout runs,
    or a policy backend without one controller per rank; then the rollout kinds it does not combine with (the
    reference trainer's rollout.keep_partial and rollout.sampling_mode): partial groups and
    streams (off-policy steps keep each group as it finishes and cut nothing). Multi-turn
    trajectories combine: each worker runs a row's trajectories whole, each turn's tokens
    stamped with the version it ran under (yatt.core.rl._turn_versions). Call it once, when
    the trainer's config is built (before any model loads). max_staleness = 0 accepts
    everything (today's step)."""
    _check_max_staleness(field, max_staleness)
    if max_staleness == 0:
        return
    if rollout_correction == "none":
        raise ValueError(
            f"{field}={max_staleness} with loss.rollout_correction='none': tokens sampled by "
            "older weights need the importance weight pi_prox / pi_behaviour (the decoupled "
            "objective); set loss.rollout_correction='token_truncate' or set "
            f"{field}=0"
        )
    if old_logprobs_from == "engine":
        raise ValueError(
            f"{field}={max_staleness} with loss.old_logprobs_from='engine': the clip must be on "
            "pi / pi_prox with pi_prox the trainer's logprobs before the update, not the "
            "engine's (several versions old); set loss.old_logprobs_from='trainer' or "
            f"{field}=0"
        )
    # Without a judge engine the placement only matters on a device without room for every
    # role, where the trainer's phases run with the workers paused whatever the placement.
    if placement in _PHASED_PLACEMENTS and has_judge_engine:
        raise ValueError(
            f"{field}={max_staleness} with placement={placement!r}: full colocation runs "
            "rollout, judge and training one after the other, so the workers cannot judge "
            "what they generate while the trainer trains; use placement='partial' or "
            f"{field}=0"
        )
    if policy_backend not in _STALENESS_POLICY_BACKENDS:
        raise ValueError(
            f"{field}={max_staleness} with backend={policy_backend!r}: off-policy steps run "
            f"with policy backends {_STALENESS_POLICY_BACKENDS}; use one of them or {field}=0"
        )
    given = f"{field}={max_staleness}"
    if should_keep_partial:
        raise ValueError(
            f"{given} with rollout.keep_partial=True: off-policy steps never cut a group (a "
            f"slow one is trained a step later), so there is nothing to resume; set "
            f"rollout.keep_partial=false or {field}=0"
        )
    if sampling_mode != "rounds":
        raise ValueError(
            f"{given} with rollout.sampling_mode={sampling_mode!r}: off-policy steps stream "
            f"groups to the trainer themselves; set rollout.sampling_mode='rounds' or {field}=0"
        )


class AdmissionControl:
    """How many new prompts may start now so that none starts more than max_staleness versions
    before the step that trains it (the rule in the module docstring). Not thread-safe: the
    caller holds its lock (yatt.core.rl._async_rollout does)."""

    def __init__(self, *, max_staleness: int, prompts_per_step: int) -> None:
        _check_max_staleness("max_staleness", max_staleness)
        if (
            isinstance(prompts_per_step, bool)
            or not isinstance(prompts_per_step, int)
            or prompts_per_step < 1
        ):
            raise ValueError(f"prompts_per_step={prompts_per_step!r}: must be an int >= 1")
        self.max_staleness = max_staleness
        self.prompts_per_step = prompts_per_step
        self.num_started = 0  # prompts started so far that hold (or held) a training slot
        self.num_short_slots = 0  # slots steps left unconsumed (record_step)

    def num_admissible(self, *, version: int) -> int:
        """Prompts that may start now under weights `version` (0 when none may)."""
        _check_version(version)
        limit = (version + self.max_staleness + 1) * self.prompts_per_step
        return max(0, limit - self.num_short_slots - self.num_started)

    def start(self, num_prompts: int, *, version: int) -> None:
        """Record `num_prompts` prompts started under weights `version`; more than
        num_admissible is a caller's bug (an AssertionError: an invariant, not input)."""
        allowed = self.num_admissible(version=version)
        assert 0 <= num_prompts <= allowed, (num_prompts, allowed, version)
        self.num_started += num_prompts

    def release(self, num_prompts: int) -> None:
        """Give back the slots of prompts started but never trained (filtered groups, rows
        unusable on resume), so generation is not slowed by them."""
        assert 0 <= num_prompts <= self.num_started, (num_prompts, self.num_started)
        self.num_started -= num_prompts

    def record_step(self, num_trained: int) -> None:
        """A step ended having trained `num_trained` of its prompts_per_step prompts (0 for a
        step a stop signal ended); the rest of its slots are never consumed."""
        assert 0 <= num_trained <= self.prompts_per_step, (num_trained, self.prompts_per_step)
        self.num_short_slots += self.prompts_per_step - num_trained

    def version_trained_at(self, prompt_number: int) -> int:
        """The version at which prompt number `prompt_number` (0-based, in start order) is
        trained at the earliest: floor(n / P)."""
        return prompt_number // self.prompts_per_step

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_staleness": self.max_staleness,
            "prompts_per_step": self.prompts_per_step,
            "num_started": self.num_started,
            "num_short_slots": self.num_short_slots,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["prompts_per_step"]) != self.prompts_per_step:
            raise ValueError(
                f"admission state has prompts_per_step={state['prompts_per_step']} but this run "
                f"has {self.prompts_per_step}; resume with the same prompts per step"
            )
        # A changed bound is allowed (the count of started prompts does not depend on it).
        self.num_started = int(state["num_started"])
        self.num_short_slots = int(state.get("num_short_slots", 0))  # absent: none recorded


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version={version!r}: a policy version is an int >= 0")
