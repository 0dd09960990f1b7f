"""DAPO dynamic sampling as an object the loop drives: over-sample, keep whole groups with reward
variance, decide collectively when every rank's batch is full.

Rounds (full colocation: the rollout phase, then the GenRM phase, then the keep decision):

    sampler = DynamicSampler(target_groups=8, oversample=2.0, max_rounds=3, group=dp_group)
    while not sampler.is_done():                  # collective: one all_reduce per round
        prompts = draw(sampler.num_to_draw())     # 0 once this rank is full; it still joins
        groups = score(generate(prompts))
        sampler.add(groups)                       # keep: whole groups with reward variance
    batch, stats = sampler.take()                 # collective: one all_reduce

Streaming (partial colocation: prompts keep entering while verdicts come back):

    sampler = DynamicSampler(..., mode="stream")
    feed(draw(sampler.num_to_draw()))
    for each group whose samples are all judged, as it arrives:
        sampler.add(group)
        if sampler.should_abort():                # every rank is full (polls, never blocks)
            engine.abort()                        # cut the long tail; count what it cut
        elif more := sampler.num_to_draw(in_flight=num_groups_in_flight):
            feed(draw(more))                      # keep the engine fed
    batch, stats = sampler.take()                 # waits until every rank is done

A stop signal ends a step that cannot end: sampler.request_stop() on the rank that got it (at
a safe point: between rounds, or between judged groups of a stream); the next is_done() is True
on every rank, and take() says stats["is_stopped"] = 1 on every rank (its all_reduce carries
the flag), never raising for an unfilled batch then: the loop saves instead of training.

Over-sampling: a draw asks for ceil(missing * factor) prompts, factor = 1 / max(keep rate,
1 / max_oversample), so between 1 and max_oversample. Rounds: the keep rate is kept / judged
groups of this step so far (over all ranks at the last round's all_reduce), else the previous
step's over all ranks, else the factor is `oversample` (the first step's). Stream (this rank's
own counts: no per-round collective): (kept + n0 * prior) / (judged + n0), prior = the previous
step's rate over all ranks (else 1 / oversample), n0 = target_groups, so the first dropped
group does not set the rate to 0. should_adapt=False keeps `oversample` throughout.

Fill probability (fill_probability=q, None by default): the mean above fills the batch only
about half the time (a round that draws it comes back short half the time; a stream that keeps
it in flight fills only once nearly every group in flight is judged, so the longest tails
always finish and the abort has nothing to cut). With q, a draw aims instead for the smallest n
with P(Binomial(n, p) >= missing) >= q, p = the keep rate above (1 / oversample before any, and
throughout with should_adapt=False): rounds draw n, a stream keeps n in flight. The binomial
tail is summed term by term (log space; no normal approximation). Two bounds, the smaller wins:
n <= ceil(missing * max_oversample) (a keep rate near 0 would ask for thousands), and a stream
never draws past the step's draw budget (see the class), even if that leaves P below q.

Surplus: groups with variance beyond the target are dropped, deterministically: the first
`target_groups` in order of arrival are kept (a stream's arrival order is the engine's). They
are not carried to the next step, which would train on responses one policy version old.

Collectives (over `group`, the data-parallel group). Rounds: every rank runs the same number of
rounds, so an engine whose generate() is itself collective stays in step; a full rank draws 0
and still calls is_done(). Stream: a rank posts one non-blocking all_reduce when it is full (or,
from take(), when it has nothing left to draw or wait for); should_abort() is True once every
rank has posted, so all ranks abort at once. take() then reduces the step's counts in one
all_reduce. The numbers are group counts (ints); nothing else crosses ranks. In a stream, issue
no other collective on `group` between the step's first draw and take(): ranks post the signal
at different times, so another collective would pair with it. With a "cpu:gloo,cuda:nccl"
group the signal is a gloo all_reduce on the host; on a NCCL-only group it is a pending NCCL
kernel that other NCCL work on that communicator queues behind.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Literal

import torch
import torch.distributed as dist

from yatt.core.data._batch import Batch
from yatt.core.rl._advantages import mask_groups_with_reward_variance
from yatt.core.rl._rollout_samples import rollout_batch
from yatt.core.runtime._repeated_log import RepeatedWarning

logger = logging.getLogger("yatt.core")

SamplingMode = Literal["rounds", "stream"]
OnUnfilled = Literal["train", "error"]


class UnfilledBatchError(RuntimeError):
    """A step's batch stayed unfilled after max_rounds with on_unfilled="error"; the message names
    the keep rate. Raised on every rank at once (the decision is collective)."""


class DynamicSampler:
    """This step's groups with reward variance, up to `target_groups` per rank; see the module
    docstring for the loops that drive it.

    target_groups: groups this rank trains on per step (its prompts per step).
    oversample: prompts drawn per missing group before any keep rate was seen (>= 1).
    max_oversample: the adapted factor's ceiling (>= oversample); also bounds a stream's draws.
    should_adapt: adapt the factor to the observed keep rate (else `oversample` always).
    max_rounds: rounds per step (rounds mode); a stream may draw at most what max_rounds rounds
        at max_oversample could: max_rounds * ceil(target_groups * max factor) groups.
    tolerance: a group whose max - min reward is <= tolerance has no variance (DAPO eq. 11).
    on_unfilled: after max_rounds, "train" on the groups there are (logged), or "error".
    mode: "rounds" (is_done() per round) or "stream" (should_abort() per arrival).
    fill_probability: None (draw the expected number of groups), or q in (0, 1): draw the
        fewest groups that fill the batch with probability q (0.9: over-sample, cut the tail).
    num_prompts: the prompts this rank's data holds, when known: target_groups must fit in it.
    group: the data-parallel process group (None: the world, or no collective at all).
    """

    def __init__(
        self,
        *,
        target_groups: int,
        oversample: float = 1.0,
        max_oversample: float = 4.0,
        should_adapt: bool = True,
        max_rounds: int = 3,
        tolerance: float = 0.0,
        on_unfilled: OnUnfilled = "train",
        mode: SamplingMode = "rounds",
        fill_probability: float | None = None,
        num_prompts: int | None = None,
        group: dist.ProcessGroup | None = None,
        group_key: str = "group_id",
        reward_key: str = "reward",
    ) -> None:
        _check_config(
            target_groups=target_groups,
            oversample=oversample,
            max_oversample=max_oversample,
            should_adapt=should_adapt,
            max_rounds=max_rounds,
            tolerance=tolerance,
            on_unfilled=on_unfilled,
            mode=mode,
            fill_probability=fill_probability,
            num_prompts=num_prompts,
        )
        self.target_groups = target_groups
        self.fill_probability = None if fill_probability is None else float(fill_probability)
        self.oversample = float(oversample)
        self.max_oversample = float(max_oversample)
        self.should_adapt = should_adapt
        self.max_rounds = max_rounds
        self.tolerance = float(tolerance)
        self.on_unfilled = on_unfilled
        self.mode = mode
        self.group = group
        self.group_key = group_key
        self.reward_key = reward_key
        max_factor = self.max_oversample if should_adapt else self.oversample
        # A stream has no rounds; it may draw what max_rounds rounds could at most.
        self.max_groups_per_step = max_rounds * _ceil(target_groups * max_factor)
        self.last_keep_rate: float | None = None  # the previous step's, over all ranks
        # An unfilled step is logged the first time, then once per 50 (it is a metric too).
        self.unfilled_warning = RepeatedWarning(logger, metric="dynamic_sampling/is_filled")
        self._start_step()

    def _start_step(self) -> None:
        self._kept: list[Batch] = []  # renumbered groups 0..target_groups-1, in arrival order
        self._schema: Batch | None = None  # the fields of an empty batch
        self._num_kept = 0  # groups with reward variance, surplus included
        self._num_judged = 0  # groups offered to add()
        self._num_drawn = 0
        self._num_aborted = 0
        self._num_aborted_tokens = 0
        self._num_rounds = 0  # rounds: rounds begun; stream: draws of at least one prompt
        self._first_factor: float | None = None
        self._global_kept = self._global_judged = 0  # rounds: at the last round's all_reduce
        self._is_round_open = False
        self._is_done = False
        self._done_signal: _DoneSignal | None = None  # stream: posted once this rank is done
        self._is_stop_requested = False  # request_stop(): a stop signal on this rank

    # -- what the loop reads -----------------------------------------------------------------

    @property
    def num_kept(self) -> int:
        """Groups of this step with reward variance kept so far on this rank (<= target)."""
        return min(self._num_kept, self.target_groups)

    @property
    def num_missing(self) -> int:
        return self.target_groups - self.num_kept

    @property
    def is_full(self) -> bool:
        """This rank has its target groups (other ranks may not)."""
        return self._num_kept >= self.target_groups

    @property
    def keep_rate(self) -> float | None:
        """The estimate the next draw uses (see the module docstring); None before any."""
        if self.mode == "rounds":
            kept, judged = self._global_kept, self._global_judged
            if judged:
                return kept / judged
            return self.last_keep_rate
        if not self._num_judged and self.last_keep_rate is None:
            return None
        # A stream's own rate is that of its first few groups: one dropped group would make it
        # 0 and the next top-up draw max_oversample x the missing groups at once. So the
        # previous step's rate (else 1 / oversample) weighs as target_groups judged groups
        # (a Beta prior): (kept + n0 * prior) / (judged + n0).
        prior = self.last_keep_rate
        if prior is None:
            prior = 1.0 / self.oversample
        n0 = self.target_groups
        return (self._num_kept + n0 * prior) / (self._num_judged + n0)

    @property
    def oversample_factor(self) -> float:
        """Prompts the next draw asks per missing group."""
        rate = self.keep_rate
        if not self.should_adapt or rate is None:
            return self.oversample
        return 1.0 / max(rate, 1.0 / self.max_oversample)

    def _num_wanted(self) -> int:
        """Groups a round draws, or a stream keeps in flight: the expected number to fill the
        batch, or with fill_probability the fewest that fill it with that probability."""
        missing = self.num_missing
        if self.fill_probability is None:
            return _ceil(missing * self.oversample_factor)
        rate = self.keep_rate if self.should_adapt else None
        if rate is None:
            rate = 1.0 / self.oversample
        cap = _ceil(missing * self.max_oversample)
        return _num_to_fill(missing, rate, self.fill_probability, cap)

    def num_to_draw(self, *, in_flight: int = 0) -> int:
        """How many prompts to draw now (one group each). Rounds: call once per round, every
        rank (a full rank gets 0). Stream: call on each arrival with the number of this rank's
        groups still generating or being judged; 0 while they are expected (or, with
        fill_probability, likely enough) to fill the batch, once this rank is full, or when the
        step's draw budget is spent."""
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
            raise ValueError(f"in_flight={in_flight!r}: must be an int >= 0")
        wanted = self._num_wanted()
        if self.mode == "rounds":
            if in_flight:
                raise ValueError("in_flight is for mode='stream'; a round waits for all it drew")
            if self._is_round_open:
                raise RuntimeError("num_to_draw() twice in one round: call is_done() after add()")
            if self._is_done or self._num_rounds >= self.max_rounds:
                raise RuntimeError("the step is done (is_done() is True): call take()")
            self._num_rounds += 1
            self._is_round_open = True
            count = wanted
        else:
            if self.is_full or self._done_signal is not None:
                return 0
            budget_left = self.max_groups_per_step - self._num_drawn
            count = max(min(wanted - in_flight, budget_left), 0)
            self._num_rounds += count > 0
        if count and self._first_factor is None:
            # with fill_probability: the groups aimed for per missing group
            fill = self.fill_probability is not None and self.num_missing
            self._first_factor = wanted / self.num_missing if fill else self.oversample_factor
        self._num_drawn += count
        return count

    def add(self, groups: Batch) -> int:
        """Offer whole groups whose samples are all judged (sample fields `group_key` and
        `reward_key`; ids may repeat across calls, never within one group). Keeps those with
        reward variance up to the target, renumbered in order of arrival; returns how many of
        `groups` were kept. Local: no collective."""
        if len(groups):
            for key in (self.group_key, self.reward_key):
                if key not in groups.samples:
                    raise ValueError(f"add() got a batch without sample field {key!r}")
        if self._schema is None:
            self._schema = groups
        if not len(groups):
            return 0
        group_ids_B = groups.samples[self.group_key]
        self._num_judged += len(torch.unique(group_ids_B))
        has_variance_B = mask_groups_with_reward_variance(
            groups.samples[self.reward_key], group_ids_B, tolerance=self.tolerance
        )
        kept = groups.select(has_variance_B)
        if not len(kept):
            return 0
        renumbered_B, count = _renumber(kept.samples[self.group_key], self._num_kept)
        room = max(self.target_groups - self._num_kept, 0)
        self._num_kept += count
        if room:
            kept.samples[self.group_key] = renumbered_B.to(group_ids_B.device)
            self._kept.append(kept.select(renumbered_B < self.target_groups))
        return min(count, room)

    def record_aborted(self, num_groups: int, *, num_tokens: int = 0) -> None:
        """Count groups the abort cut (dropped, or kept as partial rollouts to resume) and the
        response tokens they had generated."""
        for name, value in (("num_groups", num_groups), ("num_tokens", num_tokens)):
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an int >= 0")
        self._num_aborted += num_groups
        self._num_aborted_tokens += num_tokens

    def request_stop(self) -> None:
        """A stop signal reached this rank: the step's rounds end at the next is_done() on
        every rank, and take() reports it (stats["is_stopped"]) on every rank. Local."""
        self._is_stop_requested = True

    # -- decisions (collective) --------------------------------------------------------------

    def is_done(self) -> bool:
        """Rounds: after each round's add(), True once every rank is full or max_rounds rounds
        ran. Collective: every rank calls it once per round (an all_reduce of 3 ints)."""
        if self.mode != "rounds":
            raise RuntimeError("is_done() is for mode='rounds'; a stream asks should_abort()")
        if self._is_done or not self._is_round_open:
            return self._is_done
        self._is_round_open = False
        # Host sync: decides whether another round runs, on every rank alike.
        num_full, kept, judged, num_stopped = _all_reduce_sum(
            [int(self.is_full), self._num_kept, self._num_judged, int(self._is_stop_requested)],
            self.group,
        )
        self._global_kept, self._global_judged = kept, judged
        is_all_full = num_full == _world_size(self.group)
        self._is_stop_requested = self._is_stop_requested or num_stopped > 0
        self._is_done = is_all_full or self._num_rounds >= self.max_rounds or num_stopped > 0
        return self._is_done

    def should_abort(self) -> bool:
        """Stream: True once every rank is full (or gave up), so in-flight requests can go.
        Never blocks: a full rank posts its signal once, then polls it."""
        if self.mode != "stream":
            raise RuntimeError("should_abort() is for mode='stream'; rounds ask is_done()")
        if self._is_done:
            return True
        if self._done_signal is None:
            if not self.is_full:
                return False
            self._done_signal = _DoneSignal(self.group)
        self._is_done = self._done_signal.is_complete()
        return self._is_done

    async def wait_for_abort(self, *, poll_s: float = 0.02) -> None:
        """Return once should_abort() is True: a task that aborts the engine while no group
        arrives (the long tail). Cancel it when the stream ends first."""
        while not self.should_abort():
            await asyncio.sleep(poll_s)

    def take(self) -> tuple[Batch, dict[str, float]]:
        """This rank's batch (up to target_groups groups, ids 0..K-1) and this rank's stats;
        starts the next step. Collective: one all_reduce (a stream first waits for every rank).
        An unfilled batch (some rank short after max_rounds) is logged; with
        on_unfilled="error" every rank raises UnfilledBatchError."""
        if self.mode == "stream":
            if self._done_signal is None:  # nothing left to draw or wait for, and not full
                self._done_signal = _DoneSignal(self.group)
            self._done_signal.wait()  # blocks until every rank's stream ended or was cut
        # Host sync: the step's counts over all ranks (the unfilled decision, the keep rate,
        # whether a stop signal ended the step on any rank).
        num_full, kept, judged, num_stopped = _all_reduce_sum(
            [int(self.is_full), self._num_kept, self._num_judged, int(self._is_stop_requested)],
            self.group,
        )
        is_stopped = num_stopped > 0
        world_size = _world_size(self.group)
        is_all_filled = num_full == world_size
        global_keep_rate = kept / judged if judged else None
        if global_keep_rate is not None:
            self.last_keep_rate = global_keep_rate
        batch = self._batch()
        stats = {
            "num_rounds": float(self._num_rounds),
            "num_groups_drawn": float(self._num_drawn),
            "num_groups_generated": float(self._num_judged),  # judged: every sample scored
            "num_groups_kept": float(self.num_kept),
            "num_groups_dropped": float(self._num_judged - self._num_kept),  # no variance
            "num_groups_surplus": float(self._num_kept - self.num_kept),
            "num_groups_aborted": float(self._num_aborted),
            "num_tokens_aborted": float(self._num_aborted_tokens),
            "keep_rate": self._num_kept / self._num_judged if self._num_judged else 0.0,
            "oversample_factor": self._first_factor or self.oversample_factor,
            "is_filled": float(self.is_full),
            "is_filled_all_ranks": float(is_all_filled),
            "is_stopped": float(is_stopped),
        }
        local = (self.num_kept, self._num_rounds, self._num_judged)
        self._start_step()
        if not is_all_filled and not is_stopped:  # a stopped step trains nothing: no error
            rate = "none judged" if global_keep_rate is None else f"{global_keep_rate:.3f}"
            summary = (
                f"{num_full} of {world_size} ranks filled; this rank kept {local[0]} of "
                f"{self.target_groups} groups after {local[1]} rounds ({local[2]} judged); "
                f"keep rate over all ranks {rate} ({kept} of {judged} groups had reward "
                "variance)"
            )
            if self.on_unfilled == "error":
                raise UnfilledBatchError(
                    f"dynamic sampling left the batch unfilled: {summary}. on_unfilled='error' "
                    "stops here: raise max_rounds or max_oversample, check the reward, or set "
                    "on_unfilled='train' to train on what there is"
                )
            self.unfilled_warning.warn(
                "dynamic sampling: training on an unfilled batch: %s", summary
            )
        return batch, stats

    def _batch(self) -> Batch:
        if self._kept:
            return Batch.concat(self._kept)
        if self._schema is not None:
            return self._schema.select([])
        return rollout_batch([])  # nothing offered at all: the rollout fields, no samples

    # -- checkpoints (between steps) ---------------------------------------------------------

    # state_dict()'s format: load_state_dict refuses another one (or a version it cannot read)
    _STATE_FORMAT = "yatt.core.DynamicSampler"
    _STATE_VERSION = 1

    def state_dict(self) -> dict[str, object]:
        """What carries from one step to the next, as plain data for a checkpoint's `extra`:
        the previous step's keep rate over all ranks (the next step's prior; None before
        any). Between steps only (after take()): RuntimeError mid-step, whose groups a
        checkpoint would lose."""
        if self._num_rounds or self._num_drawn or self._num_judged or self._num_aborted:
            raise RuntimeError(
                "DynamicSampler.state_dict() mid-step: checkpoint between steps, after take()"
            )
        return {
            "format": self._STATE_FORMAT,
            "version": self._STATE_VERSION,
            "last_keep_rate": self.last_keep_rate,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a state_dict()'s keep rate: the next step draws as the uninterrupted run's
        would. ValueError for a malformed state or another format or version."""
        where = "dynamic sampler state"
        if not isinstance(state, dict):
            raise ValueError(f"{where} is a {type(state).__name__}, not a dict from state_dict()")
        saved = (state.get("format"), state.get("version"))
        if saved != (self._STATE_FORMAT, self._STATE_VERSION):
            raise ValueError(
                f"{where}: format={state.get('format')!r} version={state.get('version')!r}, "
                f"this yatt reads {self._STATE_FORMAT!r} version {self._STATE_VERSION}: pass "
                "DynamicSampler.state_dict()'s dict, or start from the prior keep rate"
            )
        rate = state.get("last_keep_rate")
        if rate is not None and not (_is_number(rate) and 0 <= rate <= 1):
            raise ValueError(f"{where}: last_keep_rate={rate!r} must be None or in [0, 1]")
        self.last_keep_rate = None if rate is None else float(rate)


# -- helpers --------------------------------------------------------------------------------------


def _check_config(
    *,
    target_groups: int,
    oversample: float,
    max_oversample: float,
    should_adapt: bool,
    max_rounds: int,
    tolerance: float,
    on_unfilled: str,
    mode: str,
    fill_probability: float | None,
    num_prompts: int | None,
) -> None:
    if not _is_int(target_groups) or target_groups < 1:
        raise ValueError(f"target_groups={target_groups!r}: must be an int >= 1 (groups per rank)")
    if not _is_number(oversample) or not oversample >= 1:
        raise ValueError(
            f"oversample={oversample!r}: must be a number >= 1 (prompts drawn per missing "
            "group; 1 draws exactly the missing number)"
        )
    if not _is_number(max_oversample) or not max_oversample >= oversample:
        raise ValueError(
            f"max_oversample={max_oversample!r}: must be a number >= oversample ({oversample!r})"
        )
    if not isinstance(should_adapt, bool):
        raise ValueError(f"should_adapt={should_adapt!r}: must be a bool")
    if not _is_int(max_rounds) or max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r}: must be an int >= 1")
    if not _is_number(tolerance) or not tolerance >= 0:
        raise ValueError(
            f"tolerance={tolerance!r}: must be a number >= 0 (rewards within it count as equal)"
        )
    if on_unfilled not in ("train", "error"):
        raise ValueError(f"on_unfilled={on_unfilled!r}: must be 'train' or 'error'")
    if mode not in ("rounds", "stream"):
        raise ValueError(f"mode={mode!r}: must be 'rounds' or 'stream'")
    if fill_probability is not None and not (
        _is_number(fill_probability) and 0 < fill_probability < 1
    ):
        raise ValueError(
            f"fill_probability={fill_probability!r}: must be None (draw the expected number of "
            "groups) or a number in (0, 1), e.g. 0.9 (the batch fills with that probability)"
        )
    if num_prompts is not None:
        if not _is_int(num_prompts) or num_prompts < 0:
            raise ValueError(f"num_prompts={num_prompts!r}: must be None or an int >= 0")
        if target_groups > num_prompts:
            raise ValueError(
                f"target_groups={target_groups} is more than the data's {num_prompts} prompts "
                "(num_prompts): lower target_groups or give more data"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _ceil(value: float) -> int:
    # 3 * (1 / 0.3) is 10.000000000000002 in floats: not 11 prompts.
    return math.ceil(value - 1e-9)


def _binomial_tail(n: int, p: float, k: int) -> float:
    """P(Binomial(n, p) >= k), as 1 - P(X < k) summed term by term in log space (math.lgamma:
    C(n, i) p^i (1 - p)^(n - i) would overflow or underflow as floats for n in the hundreds)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n_fact = math.lgamma(n + 1)
    below = sum(
        math.exp(
            log_n_fact - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        )
        for i in range(k)
    )
    return max(0.0, 1.0 - below)


def _num_to_fill(missing: int, rate: float, probability: float, cap: int) -> int:
    """The fewest groups n (missing <= n <= cap) of which at least `missing` have reward
    variance with `probability`, each one with probability `rate`; `cap` if none does."""
    if missing <= 0:
        return 0
    # Reached within float rounding: the tail of 3 draws at 1/2 for 2 is 0.49999999999999967.
    reached = probability - 1e-12
    if _binomial_tail(cap, rate, missing) < reached:
        return cap
    lo, hi = missing, cap  # the tail grows with n: bisect for the first n that reaches it
    while lo < hi:
        mid = (lo + hi) // 2
        if _binomial_tail(mid, rate, missing) >= reached:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _renumber(group_ids_B: torch.Tensor, offset: int) -> tuple[torch.Tensor, int]:
    """Group ids as offset, offset + 1, ... in order of first appearance."""
    order: dict[int, int] = {}
    for g in group_ids_B.tolist():
        order.setdefault(g, offset + len(order))
    renumbered = [order[g] for g in group_ids_B.tolist()]
    return torch.as_tensor(renumbered, dtype=torch.int64), len(order)


def _is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if _is_distributed(group) else 1


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_sum(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    if not _is_distributed(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [int(v) for v in t.tolist()]


class _DoneSignal:
    """One non-blocking all_reduce per rank and step: complete once every rank has posted."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._work = None
        if _is_distributed(group):
            t = torch.ones(1, dtype=torch.int64, device=_collective_device(group))
            self._work = dist.all_reduce(t, group=group, async_op=True)

    def is_complete(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
