"""Admission control and the staleness config (issue 48): fast, single process.

The rule is stated independently here: prompt number n (0-based, in start order) is trained
at version floor(n / P) at the earliest (the trainer takes P prompts per step), so starting it
under weights w keeps its age floor(n / P) - w within the bound s, and starting the next one
beyond the admitted count would not."""

NUM_GPUS = 0

import itertools

import pytest

from yatt.core import AdmissionControl, InFlightPrompts, StalenessConfig, check_staleness


@pytest.mark.parametrize(
    ("s", "prompts_per_step", "version", "num_started", "expected"),
    [
        pytest.param(0, 4, 0, 0, 4, id="on-policy-first-step"),
        pytest.param(0, 4, 0, 4, 0, id="on-policy-waits-for-the-next-weights"),
        pytest.param(0, 4, 1, 4, 4, id="on-policy-next-step"),
        pytest.param(1, 4, 0, 0, 8, id="s1-one-step-ahead"),
        pytest.param(1, 4, 0, 7, 1, id="s1-last-slot"),
        pytest.param(2, 3, 1, 5, 7, id="s2-mid-run"),
        pytest.param(1, 2, 0, 9, 0, id="past-the-limit-is-zero"),
    ],
)
def test_num_admissible_by_hand(s, prompts_per_step, version, num_started, expected):
    admission = AdmissionControl(max_staleness=s, prompts_per_step=prompts_per_step)
    admission.num_started = num_started
    assert admission.num_admissible(version=version) == expected


@pytest.mark.parametrize(
    ("s", "prompts_per_step"), list(itertools.product([0, 1, 2, 3], [1, 2, 5]))
)
def test_every_admitted_prompt_is_within_the_bound_and_one_more_would_not_be(s, prompts_per_step):
    admission = AdmissionControl(max_staleness=s, prompts_per_step=prompts_per_step)
    started_under = []  # the weights version each prompt started under, by prompt number
    for version in range(6):
        # Start one at a time, as a generator thread would, until admission says stop.
        while admission.num_admissible(version=version) > 0:
            admission.start(1, version=version)
            started_under.append(version)
        n = len(started_under)  # the next prompt's number: it would be too old
        assert n // prompts_per_step - version == s + 1
    for n, w in enumerate(started_under):
        assert 0 <= n // prompts_per_step - w <= s, (n, w)
        assert admission.version_trained_at(n) == n // prompts_per_step


def test_released_slots_are_admitted_again_and_overdrawing_is_a_bug():
    admission = AdmissionControl(max_staleness=1, prompts_per_step=2)
    admission.start(4, version=0)
    assert admission.num_admissible(version=0) == 0
    admission.release(1)  # a filtered group: its slot comes back
    assert admission.num_admissible(version=0) == 1
    with pytest.raises(AssertionError):
        admission.start(2, version=0)


def test_admission_state_round_trips():
    admission = AdmissionControl(max_staleness=2, prompts_per_step=3)
    admission.start(5, version=0)
    resumed = AdmissionControl(max_staleness=2, prompts_per_step=3)
    resumed.load_state_dict(admission.state_dict())
    assert resumed.num_admissible(version=1) == admission.num_admissible(version=1) == 7
    with pytest.raises(ValueError, match="prompts_per_step=3"):
        AdmissionControl(max_staleness=2, prompts_per_step=4).load_state_dict(
            admission.state_dict()
        )


# -- config ------------------------------------------------------------------------------------

GOOD = {
    "max_staleness": 1,
    "rollout_correction": "token_truncate",
    "old_logprobs_from": "trainer",
    "placement": "partial",
    "policy_backend": "torch",
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param({"max_staleness": -1}, r"rollout.max_staleness=-1", id="negative"),
        pytest.param({"max_staleness": 1.5}, r"rollout.max_staleness=1.5", id="not-int"),
        pytest.param({"rollout_correction": "none"}, r"loss.rollout_correction='none'", id="no-is"),
        pytest.param(
            {"old_logprobs_from": "engine"}, r"loss.old_logprobs_from='engine'", id="engine"
        ),
        pytest.param({"placement": "full"}, r"placement='full'", id="phased-placement"),
        pytest.param({"policy_backend": "megatron"}, r"backend='megatron'", id="backend"),
        pytest.param(
            {"should_keep_partial": True}, r"=1 with rollout.keep_partial=True", id="keep-partial"
        ),
        pytest.param(
            {"sampling_mode": "stream"}, r"=1 with rollout.sampling_mode='stream'", id="stream"
        ),
    ],
)
def test_check_staleness_refuses_what_cannot_hold(change, match):
    check_staleness(**GOOD)
    with pytest.raises(ValueError, match=match):
        check_staleness(**(GOOD | change))


def test_full_colocation_holds_without_a_judge_engine():
    # reward functions or an endpoint: nothing sleeps under the workers' judging
    check_staleness(**(GOOD | {"placement": "full", "has_judge_engine": False}))
    with pytest.raises(ValueError, match=r"placement='full'"):
        check_staleness(**(GOOD | {"placement": "full", "has_judge_engine": True}))


def test_on_policy_accepts_every_setting_and_the_config_checks_its_field():
    check_staleness(
        **(
            GOOD
            | {
                "max_staleness": 0,
                "rollout_correction": "none",
                "old_logprobs_from": "engine",
                "placement": "full",
                "policy_backend": "megatron",
            }
        )
    )
    assert not StalenessConfig().is_off_policy and StalenessConfig(max_staleness=2).is_off_policy
    with pytest.raises(ValueError, match=r"StalenessConfig.max_staleness=-1"):
        StalenessConfig(max_staleness=-1)


# -- in-flight prompts ---------------------------------------------------------------------------


def test_in_flight_state_round_trips_every_prompt_finished_or_requeued():
    in_flight = InFlightPrompts()
    for number, row in enumerate([7, 3, 7, 9]):  # row 7 twice: drawn again next epoch
        in_flight.add(number, row_index=row, version=number // 2)
    in_flight.finish(2, {"versions": [1, 1]})
    in_flight.finish(0, {"versions": [0, 1]})
    state = in_flight.state_dict()
    resumed = InFlightPrompts()
    resumed.load_state_dict(state)
    assert len(resumed) == 4 and resumed.num_finished == 2
    assert [(p.number, p.row_index, p.version) for p in resumed.unfinished()] == [
        (1, 3, 0),
        (3, 9, 1),
    ]
    # Finished ones come back in finish order with their results, and leave once taken.
    taken = resumed.take_finished(2)
    assert [(p.number, p.result) for p in taken] == [
        (2, {"versions": [1, 1]}),
        (0, {"versions": [0, 1]}),
    ]
    assert len(resumed) == 2 and 2 not in resumed
    with pytest.raises(ValueError, match="twice"):
        InFlightPrompts().load_state_dict(
            {"prompts": state["prompts"] + state["prompts"][:1], "num_finished": 2}
        )


def test_a_step_that_trains_fewer_than_p_keeps_its_slots_from_new_prompts():
    # s = 1, P = 4. Step 0 trains 4 prompts, step 1 (a stop signal, or an unfilled batch)
    # trains none, yet the version moves to 2. Prompts pending then: 8 started after the 4
    # trained (12 - 4). A new prompt waits behind them: trained at step 2 + 8 / 4 = 4, age
    # 4 - 2 = 2 > s, so none may start; counting versions alone would let 4 start.
    admission = AdmissionControl(max_staleness=1, prompts_per_step=4)
    admission.start(8, version=0)
    admission.record_step(4)
    admission.start(admission.num_admissible(version=1), version=1)
    assert admission.num_started == 12
    admission.record_step(0)
    assert admission.num_admissible(version=2) == 0
    # step 2 trains its 4: one more step's prompts may start at version 3
    admission.record_step(4)
    assert admission.num_admissible(version=3) == 4
    resumed = AdmissionControl(max_staleness=1, prompts_per_step=4)
    resumed.load_state_dict(admission.state_dict())
    assert resumed.num_admissible(version=3) == 4
