"""PartialRollouts' and DynamicSampler's state_dict()/load_state_dict(): what a checkpoint between
steps keeps of them. Expected values come from hand-built groups and the rules in the module
docstrings (a group is resumed at most one step after its oldest tokens; keep rate = kept /
judged groups), never from the saved dict itself."""

import io
import json
import math

import pytest
import torch

from yatt.core import Batch, DynamicSampler, PartialGroup, PartialRollouts, PartialSample

NUM_GPUS = 0


def _sample(prompt, response, logprobs, reason):
    return PartialSample(
        prompt_ids=prompt, response_ids=response, logprobs=logprobs, finish_reason=reason
    )


def _held() -> PartialRollouts:
    """Three cut groups: two cut at step 3 (one resumed from step 2, so it keeps step 2)."""
    partials = PartialRollouts(rollout_correction="token_tis")
    partials.num_resumed, partials.num_dropped_stale = 5, 2  # as after earlier steps
    partials.put(
        PartialGroup(
            samples=[
                _sample([1, 2], [5, 6], [-0.125, -1.5], "abort"),
                _sample([1, 2], [9], [-0.5], "stop"),
            ],
            step=3,
            prompt={"prompt": "1+1", "_index": 7},
        )
    )
    partials.put(
        PartialGroup(
            samples=[_sample([3], [4, 4, 4], [-2.0, -math.inf, -0.0], "abort")],
            step=2,  # resumed at step 3 and cut again: too old for step 4
            prompt={"prompt": "2+2", "_index": 8},
        )
    )
    partials.put(
        PartialGroup(
            samples=[_sample([8, 9], [], [], "abort"), _sample([8, 9], [1], [-0.25], "length")],
            step=3,
            prompt={"prompt": "3+3", "_index": 9},
        )
    )
    return partials


def _through_json(state):
    # yatt.ckpt stores a rank's `extra` as JSON: tuples come back as lists, -inf as -Infinity.
    return json.loads(json.dumps(state))


def _fresh() -> PartialRollouts:
    return PartialRollouts(rollout_correction="token_tis")


@pytest.mark.parametrize("storage", ["json", "torch_save"])
def test_a_restored_partial_rollouts_resumes_the_same_groups_next_step(storage):
    state = _held().state_dict()
    if storage == "json":
        state = _through_json(state)
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    restored = _fresh()
    assert restored.load_state_dict(state) == 0
    assert len(restored) == 3

    groups = restored.take(step=4)
    # 4 - 3 <= 1: the two step-3 groups, in the order they were put; 4 - 2 > 1: dropped
    assert [g.prompt["_index"] for g in groups] == [7, 9]
    assert [g.step for g in groups] == [3, 3]
    assert restored.num_dropped_stale == 2 + 1 and restored.num_resumed == 5 + 2
    first, third = groups
    cut, done = first.samples
    assert cut.resume_prompt_ids() == [1, 2, 5, 6] and cut.num_tokens_left(8) == 6
    assert cut.logprobs == (-0.125, -1.5) and not cut.is_finished
    assert (done.response_ids, done.logprobs, done.finish_reason) == ((9,), (-0.5,), "stop")
    assert [s.resume_prompt_ids() for s in third.unfinished()] == [[8, 9]]
    assert third.samples[1].finish_reason == "length"


def test_minus_infinity_logprobs_survive_the_json_of_a_checkpoint():
    restored = _fresh()
    restored.load_state_dict(_through_json(_held().state_dict()))
    held = restored.take(step=3)  # every group still fresh at step 3
    assert held[1].samples[0].logprobs == (-2.0, -math.inf, 0.0)


def test_a_prompt_hook_stores_and_rebuilds_the_loops_prompts_and_drops_what_it_cannot():
    saved = _held().state_dict(save_prompt=lambda row: row["_index"])
    assert [g["prompt"] for g in saved["groups"]] == [7, 8, 9]
    rows = {7: "seven", 9: "nine"}  # row 8 no longer gives a prompt
    restored = _fresh()
    assert restored.load_state_dict(saved, load_prompt=rows.get) == 1
    assert [g.prompt for g in restored.take(step=3)] == ["seven", "nine"]


def test_an_empty_partial_rollouts_round_trips_to_nothing():
    restored = _fresh()
    restored.load_state_dict(_through_json(_fresh().state_dict()))
    assert len(restored) == 0 and restored.take(step=1) == []


def _bad(edit):
    state = _through_json(_held().state_dict())
    edit(state)
    return state


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ([1, 2], "a list, not a dict"),
        (_bad(lambda s: s.update(version=2)), r"version=2, this yatt reads version 1"),
        (_bad(lambda s: s.update(format="other")), r"format='other'"),
        (_bad(lambda s: s.pop("num_dropped_stale")), r"num_dropped_stale=None"),
        (_bad(lambda s: s["groups"][1].update(step=-1)), r"groups\[1\]\.step=-1"),
        (_bad(lambda s: s["groups"][0].update(samples=[])), r"groups\[0\]\.samples"),
        (
            _bad(lambda s: s["groups"][0]["samples"][1]["logprobs"].append(-1.0)),
            r"groups\[0\]\.samples\[1\] has 2 logprobs for 1 response tokens",
        ),
        (
            _bad(lambda s: s["groups"][2]["samples"][0].update(prompt_ids=[8, "9"])),
            r"groups\[2\]\.samples\[0\]\.prompt_ids",
        ),
        (
            _bad(lambda s: s["groups"][0]["samples"][0]["logprobs"].__setitem__(0, math.nan)),
            r"groups\[0\]\.samples\[0\]\.logprobs",
        ),
        (_bad(lambda s: s["groups"][0].pop("prompt")), r"groups\[0\] is \['samples', 'step'\]"),
    ],
    ids=[
        "not_a_dict",
        "version",
        "format",
        "counter",
        "step",
        "no_samples",
        "logprob_count",
        "token_type",
        "nan",
        "keys",
    ],
)
def test_a_malformed_or_other_version_state_is_a_clear_error_and_changes_nothing(state, match):
    partials = _held()
    with pytest.raises(ValueError, match=match):
        partials.load_state_dict(state)
    assert len(partials) == 3 and partials.num_dropped_stale == 2  # untouched


# -- DynamicSampler ------------------------------------------------------------------------------


def _groups(rewards_per_group: list[list[float]]) -> Batch:
    rows = [
        {"input_ids": [1, 2], "group_id": g, "reward": float(r)}
        for g, rewards in enumerate(rewards_per_group)
        for r in rewards
    ]
    return Batch.from_samples(rows)


def _stream_sampler() -> DynamicSampler:
    return DynamicSampler(target_groups=2, oversample=2.0, max_oversample=4.0, mode="stream")


def test_a_restored_sampler_starts_the_next_step_from_the_saved_keep_rate():
    sampler = _stream_sampler()
    sampler.num_to_draw()
    # 3 judged, 2 with reward variance: this step's keep rate is 2 / 3
    sampler.add(_groups([[0.0, 1.0], [1.0, 1.0], [0.0, 0.5]]))
    sampler.take()
    state = _through_json(sampler.state_dict())

    restored, cold = _stream_sampler(), _stream_sampler()
    restored.load_state_dict(state)
    assert restored.last_keep_rate == pytest.approx(2 / 3)
    # a stream's estimate before its first group is the prior: last step's rate ...
    assert restored.keep_rate == pytest.approx(2 / 3)
    assert restored.oversample_factor == pytest.approx(1.5)
    # ... where a run restarted without it draws `oversample` prompts per missing group
    assert cold.keep_rate is None and cold.oversample_factor == 2.0


def test_a_sampler_before_any_step_round_trips_to_no_keep_rate():
    restored = _stream_sampler()
    restored.last_keep_rate = 0.25
    restored.load_state_dict(_through_json(_stream_sampler().state_dict()))
    assert restored.last_keep_rate is None


def test_a_sampler_checkpointed_mid_step_is_refused():
    sampler = _stream_sampler()
    sampler.num_to_draw()
    sampler.add(_groups([[0.0, 1.0]]))
    with pytest.raises(RuntimeError, match="mid-step"):
        sampler.state_dict()


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ("0.5", "a str, not a dict"),
        ({"format": "yatt.core.DynamicSampler", "version": 9, "last_keep_rate": 0.5}, "version"),
        ({"version": 1, "last_keep_rate": 0.5}, "format=None"),
        ({"format": "yatt.core.DynamicSampler", "version": 1, "last_keep_rate": 1.5}, r"\[0, 1\]"),
        ({"format": "yatt.core.DynamicSampler", "version": 1, "last_keep_rate": "x"}, r"\[0, 1\]"),
    ],
    ids=["not_a_dict", "version", "format", "rate_above_one", "rate_not_a_number"],
)
def test_a_malformed_sampler_state_is_a_clear_error(state, match):
    sampler = _stream_sampler()
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict(state)
    assert sampler.last_keep_rate is None


class _Completion:  # an engine's completion (yatt.rollout.Completion's fields the holder reads)
    def __init__(self, response, logprobs, reason) -> None:
        self.prompt_ids, self.response_ids = [1, 2], response
        self.logprobs, self.finish_reason = logprobs, reason


class _Cut:  # a stream's cut group (genrm.CutGroup's shape)
    def __init__(self, samples, step, prompt) -> None:
        self.samples, self.step, self.prompt = samples, step, prompt


def test_a_streams_cut_group_is_held_as_partial_samples():
    partials = PartialRollouts(rollout_correction="token_tis")
    cut = _Cut([_Completion([5], [-0.25], "abort"), _Completion([9], [-0.5], "stop")], 3, "p")
    partials.put(cut)
    (group,) = partials.take(4)
    assert (group.step, group.prompt) == (3, "p")
    assert [s.resume_prompt_ids() for s in group.unfinished()] == [[1, 2, 5]]
    assert [(s.response_ids, s.logprobs) for s in group.samples] == [
        ((5,), (-0.25,)),
        ((9,), (-0.5,)),
    ]


def test_the_holders_own_prompt_hooks_are_used_without_arguments():
    # what a Checkpointer calls: state_dict() and load_state_dict(state), nothing more
    saved = PartialRollouts(rollout_correction="token_tis", save_prompt=lambda p: {"text": p})
    saved.put(PartialGroup(samples=[_sample([1], [2], [-1.0], "abort")], step=0, prompt="a"))
    saved.put(PartialGroup(samples=[_sample([1], [3], [-1.0], "abort")], step=0, prompt="b"))
    state = json.loads(json.dumps(saved.state_dict()))
    assert [group["prompt"] for group in state["groups"]] == [{"text": "a"}, {"text": "b"}]
    restored = PartialRollouts(
        rollout_correction="token_tis",
        load_prompt=lambda s: None if s["text"] == "b" else s["text"].upper(),
    )
    restored.load_state_dict(state)
    assert restored.num_dropped_on_load == 1
    assert [group.prompt for group in restored.take(1)] == ["A"]
