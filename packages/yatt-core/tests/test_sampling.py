"""DynamicSampler on one process: what it keeps, how many prompts it asks for, when a stream
aborts, the unfilled policy; PartialRollouts' resumption and staleness bound. Expected values
are worked out by hand from the rules in the module docstrings (keep rate = kept / judged
groups; draw = ceil(missing / max(keep rate, 1 / max_oversample)))."""

import logging
import math
import random
import types
from fractions import Fraction

import pytest

from yatt.core import (
    Batch,
    DynamicSampler,
    PartialGroup,
    PartialRollouts,
    PartialSample,
    UnfilledBatchError,
    check_partial_resumption,
    rollout_samples,
)

NUM_GPUS = 0


def _groups(rewards_per_group: list[list[float]], *, tag: str = "") -> Batch:
    """One group per inner list (ids 0..G-1, repeated on purpose across calls); `text` tells
    the groups apart after renumbering."""
    rows = [
        {"input_ids": [1, 2, 3], "group_id": g, "reward": float(r), "text": f"{tag}{g}"}
        for g, rewards in enumerate(rewards_per_group)
        for r in rewards
    ]
    return Batch.from_samples(rows)


VARIED, FLAT = [0.0, 1.0], [1.0, 1.0]


# -- rounds ----------------------------------------------------------------------------------


def test_rounds_fill_keep_the_first_groups_in_arrival_order_and_drop_the_surplus():
    sampler = DynamicSampler(target_groups=3, oversample=2.0, should_adapt=False, max_rounds=3)
    assert not sampler.is_done()  # before any round: no decision yet
    assert sampler.num_to_draw() == 6  # 3 missing x 2
    kept = sampler.add(_groups([FLAT, VARIED, FLAT, VARIED, FLAT, FLAT], tag="a"))
    assert kept == 2 and not sampler.is_done()
    assert sampler.num_to_draw() == 2  # 1 missing x 2
    # Both have variance: the first fills the batch, the second is surplus, dropped.
    assert sampler.add(_groups([[0.0, 0.5], VARIED], tag="b")) == 1
    assert sampler.is_done()
    batch, stats = sampler.take()
    assert batch["group_id"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["text"] == ["a1", "a1", "a3", "a3", "b0", "b0"]
    assert batch["reward"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.5]
    assert stats["num_rounds"] == 2 and stats["num_groups_drawn"] == 8
    assert stats["num_groups_generated"] == 8 and stats["num_groups_kept"] == 3
    assert stats["num_groups_dropped"] == 4 and stats["num_groups_surplus"] == 1
    assert stats["keep_rate"] == 4 / 8 and stats["oversample_factor"] == 2.0
    assert stats["is_filled"] == 1.0 and stats["is_filled_all_ranks"] == 1.0


def test_rounds_adapt_the_factor_to_the_keep_rate_within_and_across_steps():
    sampler = DynamicSampler(target_groups=4, oversample=1.0, max_oversample=8.0, max_rounds=3)
    assert sampler.num_to_draw() == 4  # no keep rate seen yet: the initial factor, 1
    sampler.add(_groups([VARIED, FLAT, FLAT, FLAT]))  # keep rate 1/4
    assert not sampler.is_done()
    assert sampler.oversample_factor == 4.0
    assert sampler.num_to_draw() == 12  # 3 missing / 0.25
    sampler.add(_groups([VARIED] * 2 + [FLAT] * 10))  # 3 of 16 so far
    assert not sampler.is_done()
    assert sampler.num_to_draw() == math.ceil(1 / (3 / 16))  # 1 missing / (3/16) = 5.33 -> 6
    sampler.add(_groups([VARIED, FLAT, FLAT, FLAT, FLAT, FLAT]))  # 4 of 22
    assert sampler.is_done()
    _, stats = sampler.take()
    assert stats["is_filled"] == 1.0 and stats["oversample_factor"] == 1.0
    # The next step starts from this step's keep rate, 4/22: 4 / (4/22) = 22 prompts.
    assert sampler.last_keep_rate == 4 / 22
    assert sampler.num_to_draw() == 22


@pytest.mark.parametrize(
    ("num_kept", "num_judged", "missing", "expected"),
    [
        pytest.param(3, 10, 3, 10, id="rate-0.3-no-float-overshoot"),  # 3 / 0.3 = 10, not 11
        pytest.param(1, 10, 2, 8, id="rate-0.1-clamped-at-max"),  # 1 / max(0.1, 1/4) = 4
        pytest.param(0, 5, 2, 8, id="rate-0-max-factor"),
        pytest.param(5, 5, 2, 2, id="rate-1-no-oversampling"),
    ],
)
def test_draw_follows_the_previous_step_keep_rate(num_kept, num_judged, missing, expected):
    sampler = DynamicSampler(target_groups=missing, oversample=2.0, max_oversample=4.0)
    sampler.last_keep_rate = num_kept / num_judged
    assert sampler.num_to_draw() == expected


def test_fixed_factor_when_not_adapting():
    sampler = DynamicSampler(target_groups=2, oversample=1.5, should_adapt=False)
    sampler.last_keep_rate = 0.1
    assert sampler.num_to_draw() == 3  # 2 x 1.5, whatever the keep rate


def test_a_full_rank_draws_zero_and_max_rounds_end_the_step():
    sampler = DynamicSampler(target_groups=1, max_rounds=2, should_adapt=False)
    assert sampler.num_to_draw() == 1
    sampler.add(_groups([VARIED]))
    assert sampler.is_done()  # one rank: full is done
    with pytest.raises(RuntimeError, match="take"):
        sampler.num_to_draw()
    sampler.take()
    sampler.num_to_draw()
    with pytest.raises(RuntimeError, match="is_done"):
        sampler.num_to_draw()  # twice in one round


def test_tolerance_counts_near_equal_rewards_as_equal():
    near = [0.5, 0.5 + 1e-6]
    strict = DynamicSampler(target_groups=1, tolerance=0.0)
    strict.num_to_draw()
    assert strict.add(_groups([near])) == 1
    lenient = DynamicSampler(target_groups=1, tolerance=1e-5)
    lenient.num_to_draw()
    assert lenient.add(_groups([near])) == 0


def test_nothing_offered_gives_an_empty_batch_with_the_rollout_fields():
    sampler = DynamicSampler(target_groups=1, max_rounds=1)
    sampler.num_to_draw()
    assert sampler.is_done()
    batch, stats = sampler.take()
    assert len(batch) == 0 and {"reward", "group_id"} <= set(batch.samples)
    assert stats["keep_rate"] == 0.0 and stats["is_filled"] == 0.0


def test_add_refuses_a_batch_without_rewards():
    sampler = DynamicSampler(target_groups=1)
    batch = Batch.from_samples([{"input_ids": [1], "group_id": 0}])
    with pytest.raises(ValueError, match="'reward'"):
        sampler.add(batch)


# -- the unfilled policy ---------------------------------------------------------------------


def _unfilled_step(on_unfilled: str):
    sampler = DynamicSampler(target_groups=2, max_rounds=1, on_unfilled=on_unfilled)
    assert sampler.num_to_draw() == 2
    sampler.add(_groups([VARIED, FLAT, FLAT, FLAT]))  # 1 of 4: keep rate 0.25
    assert sampler.is_done()
    return sampler.take()


def test_unfilled_batch_trains_on_what_there_is_and_logs_the_keep_rate(caplog):
    with caplog.at_level(logging.WARNING, logger="yatt.core"):
        batch, stats = _unfilled_step("train")
    assert batch["group_id"].tolist() == [0, 0]
    assert stats["is_filled"] == 0.0 and stats["is_filled_all_ranks"] == 0.0
    assert stats["num_groups_kept"] == 1 and stats["keep_rate"] == 0.25
    assert "keep rate over all ranks 0.250" in caplog.text


def test_unfilled_batch_raises_naming_the_keep_rate():
    with pytest.raises(UnfilledBatchError, match=r"keep rate over all ranks 0\.250 \(1 of 4"):
        _unfilled_step("error")


# -- streaming -------------------------------------------------------------------------------


def test_stream_tops_up_by_the_live_keep_rate_and_aborts_once_full():
    sampler = DynamicSampler(target_groups=2, oversample=2.0, max_oversample=4.0, mode="stream")
    assert sampler.num_to_draw() == 4  # 2 missing x 2
    sampler.add(_groups([FLAT]))
    assert not sampler.should_abort()
    # Keep rate with the prior 1/2 weighing 2 groups: (0 + 1) / (1 + 2) = 1/3, factor 3:
    # 6 wanted in flight; 3 are: draw 3.
    assert sampler.num_to_draw(in_flight=3) == 3
    sampler.add(_groups([VARIED]))  # (1 + 1) / (2 + 2): factor 2, 1 missing -> 2; 5 in flight
    assert not sampler.should_abort()
    assert sampler.num_to_draw(in_flight=5) == 0
    sampler.add(_groups([VARIED]))
    assert sampler.should_abort()  # full, and the only rank
    assert sampler.num_to_draw(in_flight=6) == 0
    sampler.add(_groups([VARIED]))  # arrived before the abort took effect: surplus
    sampler.record_aborted(5, num_tokens=70)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        sampler.record_aborted(1, num_tokens=-1)
    batch, stats = sampler.take()
    assert batch["group_id"].tolist() == [0, 0, 1, 1]
    assert stats["num_rounds"] == 2 and stats["num_groups_drawn"] == 7
    assert stats["num_groups_aborted"] == 5 and stats["num_tokens_aborted"] == 70
    assert stats["num_groups_surplus"] == 1
    assert stats["oversample_factor"] == 2.0  # the factor of the step's first draw


def test_stream_keep_rate_leans_on_last_step_rate_so_one_dropped_group_draws_little():
    # Step 1 keeps 2 of 4 groups: last step's rate 1/2.
    sampler = DynamicSampler(target_groups=4, oversample=1.0, max_oversample=4.0, mode="stream")
    assert sampler.num_to_draw() == 4
    sampler.add(_groups([VARIED, FLAT, VARIED, FLAT]))
    sampler.take()
    # Step 2: the prior 1/2 weighs as 4 judged groups. Before any arrival: rate 1/2, factor 2.
    assert sampler.num_to_draw() == 8
    # One dropped group: (0 + 4 x 1/2) / (1 + 4) = 2/5, factor 5/2, 4 missing -> 10 wanted,
    # 7 in flight: 3 more (this step's own rate 0/1 would want 16: 9 more).
    sampler.add(_groups([FLAT]))
    assert sampler.keep_rate == pytest.approx(0.4)
    assert sampler.num_to_draw(in_flight=7) == 3
    # Three kept of four: (3 + 2) / (4 + 4) = 5/8, factor 8/5, 1 missing -> 2 wanted.
    sampler.add(_groups([VARIED, VARIED, VARIED]))
    assert sampler.keep_rate == pytest.approx(5 / 8)
    assert sampler.num_to_draw(in_flight=1) == 1


def test_stream_draws_no_more_than_max_rounds_rounds_could():
    sampler = DynamicSampler(
        target_groups=2, oversample=1.0, max_oversample=2.0, max_rounds=2, mode="stream"
    )
    assert sampler.max_groups_per_step == 8  # 2 rounds x ceil(2 x 2)
    assert sampler.num_to_draw() == 2
    sampler.add(_groups([FLAT, FLAT]))
    assert sampler.num_to_draw() == 4  # keep rate 0: factor 2
    sampler.add(_groups([FLAT] * 4))
    assert sampler.num_to_draw() == 2  # 4 wanted, 2 left in the budget
    sampler.add(_groups([FLAT, FLAT]))
    assert sampler.num_to_draw() == 0
    assert not sampler.should_abort()  # not full: the stream ends, take() decides
    _, stats = sampler.take()
    assert stats["num_groups_drawn"] == 8 and stats["is_filled"] == 0.0


def test_each_mode_refuses_the_other_modes_calls():
    with pytest.raises(RuntimeError, match="should_abort"):
        DynamicSampler(target_groups=1, mode="stream").is_done()
    with pytest.raises(RuntimeError, match="is_done"):
        DynamicSampler(target_groups=1).should_abort()
    with pytest.raises(ValueError, match="in_flight"):
        DynamicSampler(target_groups=1).num_to_draw(in_flight=2)


# -- fill probability -------------------------------------------------------------------------
# Expected counts from the binomial tail written out here, exactly (Fractions):
# P(Binomial(n, p) >= k) = 1 - sum_{i<k} C(n, i) p^i (1 - p)^(n - i).


def _tail(n: int, p: Fraction, k: int) -> Fraction:
    return 1 - sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k))


def _fewest(p: Fraction, k: int, q: float, cap: int) -> int:
    return next((n for n in range(k, cap + 1) if _tail(n, p, k) >= q), cap)


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        # p = 1/2, 2 missing: P(X >= 2) = 1 - (n + 1) / 2^n: n = 2: 1/4, 3: 1/2, 4: 11/16,
        # 5: 26/32, 6: 57/64, 7: 120/128. The mean, ceil(2 x 2) = 4, fills 11/16 of the time.
        pytest.param(0.3, 3, id="q-0.3-fewer-than-the-mean"),
        pytest.param(0.8, 5, id="q-0.8"),
        pytest.param(0.9, 7, id="q-0.9"),
        pytest.param(0.95, 8, id="q-0.95-capped-at-max_oversample"),  # 7: 0.9375; cap 2 x 4
    ],
)
@pytest.mark.parametrize("mode", ["rounds", "stream"])
def test_fill_probability_draws_the_fewest_groups_that_fill_with_it(mode, q, expected):
    assert expected == _fewest(Fraction(1, 2), 2, q, cap=8)
    # Before any keep rate: 1 / oversample = 1/2 (a stream's prior too).
    sampler = DynamicSampler(
        target_groups=2, oversample=2.0, max_oversample=4.0, mode=mode, fill_probability=q
    )
    assert sampler.num_to_draw() == expected
    _, stats = sampler.take()
    assert stats["oversample_factor"] == expected / 2  # the groups aimed for per missing one


def test_fill_probability_none_draws_the_mean_as_before():
    for mode in ("rounds", "stream"):
        sampler = DynamicSampler(
            target_groups=2, oversample=2.0, max_oversample=4.0, mode=mode, fill_probability=None
        )
        assert sampler.num_to_draw() == 4  # 2 missing x 2


def test_fill_probability_with_another_keep_rate_matches_the_exact_tail():
    # 1/3 (oversample 3), 3 missing, q 0.9: 3 x 3 = 9 would fill with P = 0.62.
    # P(n = 14) = 0.8947, P(n = 15) = 0.9206: 15, under the cap 3 x 8 = 24.
    assert _fewest(Fraction(1, 3), 3, 0.9, cap=24) == 15
    assert _tail(14, Fraction(1, 3), 3) < 0.9 <= _tail(15, Fraction(1, 3), 3)
    sampler = DynamicSampler(
        target_groups=3, oversample=3.0, max_oversample=8.0, fill_probability=0.9
    )
    assert sampler.num_to_draw() == 15


def test_fill_probability_keeps_enough_in_flight_as_the_stream_keep_rate_moves():
    sampler = DynamicSampler(
        target_groups=2, oversample=2.0, max_oversample=4.0, mode="stream", fill_probability=0.9
    )
    assert sampler.num_to_draw() == 7  # see the table above
    # Kept 1 of 1, prior 1/2 weighing 2 groups: rate (1 + 1) / (1 + 2) = 2/3; 1 missing:
    # 1 - (1/3)^n >= 0.9 at n = 3 (8/9 at n = 2); 6 in flight already.
    sampler.add(_groups([VARIED]))
    assert sampler.num_to_draw(in_flight=6) == 0
    # Then one dropped: (1 + 1) / (2 + 2) = 1/2; 1 - (1/2)^n >= 0.9 at n = 4 (7/8 at 3). The
    # mean, 1 missing x 2 = 2 in flight, would draw nothing here.
    sampler.add(_groups([FLAT]))
    assert sampler.keep_rate == pytest.approx(0.5)
    assert sampler.num_to_draw(in_flight=2) == 2
    sampler.add(_groups([VARIED]))
    assert sampler.should_abort() and sampler.num_to_draw(in_flight=8) == 0


def test_fill_probability_in_rounds_uses_the_rounds_keep_rate():
    sampler = DynamicSampler(
        target_groups=2, oversample=2.0, max_oversample=16.0, fill_probability=0.9
    )
    assert sampler.num_to_draw() == 7
    sampler.add(_groups([VARIED] + [FLAT] * 6))  # keep rate 1/7, 1 missing
    assert not sampler.is_done()
    # 1 - (6/7)^n >= 0.9: n >= log 0.1 / log(6/7) = 14.9 -> 15 (the mean: 7).
    assert sampler.num_to_draw() == _fewest(Fraction(1, 7), 1, 0.9, cap=16) == 15


def test_fill_probability_is_capped_by_max_oversample_then_by_the_draw_budget():
    # Rounds, last step's rate 1/4, 4 missing, q 0.999: more than the cap, 8 x 4 = 32, needs.
    capped = DynamicSampler(
        target_groups=4, oversample=1.0, max_oversample=8.0, fill_probability=0.999
    )
    capped.last_keep_rate = 0.25
    assert _tail(32, Fraction(1, 4), 4) < 0.999
    assert capped.num_to_draw() == 32
    # A stream of one round's budget, ceil(2 x 4) = 8 groups: 7 drawn first, then 3 dropped:
    # rate (0 + 1) / (3 + 2) = 1/5, P(8 in flight fill 2) = 0.50 < 0.9: the cap, 8; 4 are in
    # flight, so 4 wanted, but 1 is left of the budget.
    stream = DynamicSampler(
        target_groups=2,
        oversample=2.0,
        max_oversample=4.0,
        max_rounds=1,
        mode="stream",
        fill_probability=0.9,
    )
    assert stream.max_groups_per_step == 8
    assert stream.num_to_draw() == 7
    stream.add(_groups([FLAT, FLAT, FLAT]))
    assert _tail(8, Fraction(1, 5), 2) < 0.9
    assert stream.num_to_draw(in_flight=4) == 1
    assert stream.num_to_draw(in_flight=4) == 0  # spent


def test_fill_probability_fills_that_often_where_the_mean_fills_half_the_time():
    # 8 missing at keep rate 1/2: simulate the draws' keeps (seeded), count the filled batches.
    rng = random.Random(0)

    def fill_share(num_drawn: int) -> float:
        trials = 4000
        fills = sum(sum(rng.random() < 0.5 for _ in range(num_drawn)) >= 8 for _ in range(trials))
        return fills / trials

    mean = DynamicSampler(target_groups=8, oversample=2.0, max_oversample=4.0).num_to_draw()
    filled = DynamicSampler(
        target_groups=8, oversample=2.0, max_oversample=4.0, fill_probability=0.9
    ).num_to_draw()
    assert mean == 16 and filled > mean
    assert fill_share(mean) < 0.65  # 1 - P(X <= 7) of Binomial(16, 1/2) = 0.598
    assert fill_share(filled) >= 0.88


def test_binomial_tail_stays_exact_where_float_binomials_overflow():
    from yatt.core.rl._sampler import _binomial_tail

    # By symmetry P(X >= n/2) = (1 + P(X = n/2)) / 2 at p = 1/2; C(1200, 600) ~ 1e359.
    half = (1 + Fraction(math.comb(1200, 600), 2**1200)) / 2
    assert _binomial_tail(1200, 0.5, 600) == pytest.approx(float(half), abs=1e-12)
    assert _binomial_tail(5, 0.5, 2) == pytest.approx(26 / 32, abs=1e-15)
    assert _binomial_tail(5, 0.5, 0) == 1.0 and _binomial_tail(5, 0.5, 6) == 0.0


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"oversample": 0.5}, "oversample", id="oversample-below-1"),
        pytest.param({"oversample": 2.0, "max_oversample": 1.5}, "max_oversample", id="max-low"),
        pytest.param({"target_groups": 9, "num_prompts": 8}, "target_groups", id="target-gt-data"),
        pytest.param({"tolerance": -0.1}, "tolerance", id="tolerance-negative"),
        pytest.param({"tolerance": float("nan")}, "tolerance", id="tolerance-nan"),
        pytest.param({"target_groups": 0}, "target_groups", id="target-0"),
        pytest.param({"max_rounds": 0}, "max_rounds", id="rounds-0"),
        pytest.param({"on_unfilled": "skip"}, "on_unfilled", id="policy-unknown"),
        pytest.param({"mode": "async"}, "mode", id="mode-unknown"),
        pytest.param({"fill_probability": 0.0}, "fill_probability", id="fill-0"),
        pytest.param({"fill_probability": 1.0}, "fill_probability", id="fill-1"),
        pytest.param({"fill_probability": 1.5}, "fill_probability", id="fill-above-1"),
        pytest.param({"fill_probability": float("nan")}, "fill_probability", id="fill-nan"),
        pytest.param({"fill_probability": "0.9"}, "fill_probability", id="fill-str"),
        pytest.param({"fill_probability": True}, "fill_probability", id="fill-bool"),
    ],
)
def test_bad_settings_name_their_field(kwargs, field):
    settings = {"target_groups": 4, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field}="):
        DynamicSampler(**settings)


def test_a_target_that_fits_the_data_is_accepted():
    DynamicSampler(target_groups=8, num_prompts=8)


# -- partial rollouts ------------------------------------------------------------------------


def _cut(prompt, response, logprobs, reason="abort"):
    return PartialSample(
        prompt_ids=prompt, response_ids=response, logprobs=logprobs, finish_reason=reason
    )


@pytest.mark.parametrize("setting", [None, False, "", "none", "Off"])
def test_resumption_without_rollout_correction_is_refused(setting):
    with pytest.raises(ValueError, match=r"^loss\.rollout_correction="):
        check_partial_resumption(rollout_correction=setting, field_name="loss.rollout_correction")
    with pytest.raises(ValueError, match=r"^rollout_correction="):
        PartialRollouts(rollout_correction=setting)


def test_resumed_response_keeps_the_old_engine_logprobs_and_appends_the_new():
    cut = _cut([7, 8], [3, 4], [-0.5, -0.25])
    assert cut.resume_prompt_ids() == [7, 8, 3, 4] and cut.num_tokens_left(5) == 3

    # What an engine returns for the resumed request.
    continuation = types.SimpleNamespace(
        prompt_ids=[7, 8, 3, 4], response_ids=[9, 2], logprobs=[-1.0, -2.0], finish_reason="stop"
    )
    done = cut.resumed(continuation)
    assert done.response_ids == (3, 4, 9, 2) and done.is_finished
    assert done.logprobs == (-0.5, -0.25, -1.0, -2.0)
    # It trains as a completion: the loss on every response token, each with its logprob.
    (sample,) = rollout_samples([done], rewards=[1.0], group_ids=[0])
    assert sample["input_ids"] == [7, 8, 3, 4, 9, 2]
    assert sample["loss_mask"] == [0, 0, 1, 1, 1, 1]
    assert sample["rollout_logprobs"] == [0.0, 0.0, -0.5, -0.25, -1.0, -2.0]
    continuation.prompt_ids = [7, 8]
    with pytest.raises(ValueError, match="resume_prompt_ids"):
        cut.resumed(continuation)


def test_partial_sample_needs_a_logprob_per_token():
    with pytest.raises(ValueError, match="2 logprobs for 3"):
        _cut([1], [1, 2, 3], [-0.1, -0.2])


def test_partial_groups_are_resumed_one_step_later_and_dropped_after():
    partials = PartialRollouts(rollout_correction="token_tis")
    finished = _cut([1], [5, 6], [-0.1, -0.2], reason="stop")
    cut = _cut([1], [5], [-0.3])
    partials.put(PartialGroup(samples=[finished, cut], step=3, prompt="row-a"))
    partials.put(PartialGroup(samples=[cut], step=2, prompt="row-b"))  # already resumed once
    resumed = partials.take(step=4)
    assert [group.prompt for group in resumed] == ["row-a"]
    assert resumed[0].unfinished() == [cut]
    assert resumed[0].samples[0].logprobs == (-0.1, -0.2)  # kept as the engine gave them
    assert partials.num_resumed == 1 and partials.num_dropped_stale == 1 and len(partials) == 0
    # Cut again at step 4, it keeps its first step (3): at step 5 it is two steps old.
    partials.put(resumed[0])
    assert partials.take(step=5) == [] and partials.num_dropped_stale == 2


def test_a_stop_request_ends_the_rounds_and_take_reports_it_without_an_unfilled_error():
    from yatt.core import Batch, DynamicSampler

    sampler = DynamicSampler(target_groups=2, max_rounds=1000, on_unfilled="error")
    flat = Batch.from_samples([{"input_ids": [1], "group_id": 0, "reward": r} for r in (1.0, 1.0)])
    sampler.num_to_draw()
    sampler.add(flat)  # no variance: the round leaves the rank short
    assert not sampler.is_done()  # another round would run
    sampler.num_to_draw()
    sampler.add(flat)
    sampler.request_stop()  # a stop signal between rounds
    assert sampler.is_done()
    batch, stats = sampler.take()  # unfilled, yet no UnfilledBatchError: the loop saves
    assert stats["is_stopped"] == 1.0 and len(batch) == 0
    # the next step starts clean
    sampler.num_to_draw()
    sampler.add(flat)
    assert not sampler.is_done()
