"""genrm.judge_in_rounds: rounds of draw -> judge -> keep until the sampler is done, a full
rank joining each round with an empty keep, a stop read between rounds or raised by the judge."""

NUM_GPUS = 0

import pytest

from yatt import genrm


class _RoundsSampler:
    """A DynamicSampler's round protocol with a script: `wants[r]` prompts in round r (0 = a
    full rank), done after len(wants) rounds or at the round after a stop request; notes the
    calls in order."""

    def __init__(self, wants: list[int]) -> None:
        self.wants, self.calls = wants, []
        self.num_rounds = 0
        self.is_stop_requested = False

    def num_to_draw(self) -> int:
        self.calls.append("num_to_draw")
        return self.wants[self.num_rounds]

    def is_done(self) -> bool:
        self.calls.append("is_done")
        if self.calls.count("num_to_draw") > self.num_rounds:
            self.num_rounds += 1  # the round that num_to_draw opened is closed here
        return self.is_stop_requested or self.num_rounds == len(self.wants)

    def request_stop(self) -> None:
        self.calls.append("request_stop")
        self.is_stop_requested = True


def _run(sampler, judge_round, should_stop=lambda: False):
    drawn, kept = [], []

    def draw(n):
        drawn.append(n)
        return [f"p{len(drawn)}-{i}" for i in range(n)]

    num_rounds = genrm.judge_in_rounds(
        sampler, draw=draw, judge_round=judge_round, keep=kept.append, should_stop=should_stop
    )
    return num_rounds, drawn, kept


def test_rounds_run_until_done_and_a_full_rank_joins_each_round_with_an_empty_keep():
    sampler = _RoundsSampler([2, 0, 1])
    rounds_seen = []

    def judge_round(prompts, num_round):
        rounds_seen.append(num_round)
        return [p + "!" for p in prompts]

    num_rounds, drawn, kept = _run(sampler, judge_round)
    assert (num_rounds, drawn, rounds_seen) == (2, [2, 1], [1, 2])  # rounds that drew
    assert kept == [["p1-0!", "p1-1!"], [], ["p2-0!"]]  # one keep per round, empty included
    assert sampler.calls.count("is_done") == 4 and "request_stop" not in sampler.calls


def test_a_stop_flag_ends_the_rounds_after_the_round_it_arrived_in():
    sampler = _RoundsSampler([1, 1, 1, 1])
    num_rounds, _, kept = _run(sampler, lambda prompts, r: list(prompts), lambda: True)
    assert (num_rounds, len(kept)) == (1, 1)
    assert sampler.calls == ["is_done", "num_to_draw", "request_stop", "is_done"]


def test_a_judge_stopped_while_it_waits_keeps_nothing_and_ends_the_rounds():
    sampler = _RoundsSampler([1, 1, 1])

    def judge_round(prompts, num_round):
        if num_round == 2:
            raise genrm.ScoringStopped(num_samples=len(prompts), waited_s=0.0)
        return list(prompts)

    num_rounds, _, kept = _run(sampler, judge_round)
    assert num_rounds == 2 and kept == [["p1-0"]]  # round 2 stopped: no keep, no add
    assert sampler.calls[-2:] == ["request_stop", "is_done"]


def test_another_error_of_the_judge_is_raised():
    sampler = _RoundsSampler([1])

    def judge_round(prompts, num_round):
        raise RuntimeError("the judge broke")

    with pytest.raises(RuntimeError, match="the judge broke"):
        _run(sampler, judge_round)
