"""GroupJudging: whole groups back once judged, aborted completions never judged."""

NUM_GPUS = 0

import asyncio
from dataclasses import dataclass, field

import pytest

from yatt.genrm import (
    GenRM,
    GroupJudging,
    JudgeTemplate,
    Sample,
    Verdict,
    YesNoParser,
)
from yatt.genrm.testing import FakeJudgeEngine

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Completion:
    text: str
    finish_reason: str = "stop"


@dataclass
class _GatedScorer:
    """Each sample's verdict waits until the test opens its gate (reward: len(response))."""

    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    async def ascore(self, samples):
        (sample,) = samples
        self.seen.append(sample.response)
        gate = self.gates.setdefault(sample.response, asyncio.Event())
        await gate.wait()
        return [Verdict(sample_id=sample.id, reward=float(len(sample.response)), status="ok")]

    def open(self, response: str) -> None:
        self.gates.setdefault(response, asyncio.Event()).set()


def _to_sample(c: _Completion) -> Sample:
    return Sample(prompt="q", response=c.text)


def test_a_group_comes_back_whole_once_every_sample_is_judged():
    async def main():
        scorer = _GatedScorer()
        judging = GroupJudging(scorer, _to_sample, group_size=2)
        judging.add(_Completion("a"), group="g1", index=1)
        judging.add(_Completion("bb"), group="g2", index=0)
        judging.add(_Completion("ccc"), group="g1", index=0)
        judging.add(_Completion("dddd"), group="g2", index=1)
        await asyncio.sleep(0)
        assert sorted(scorer.seen) == ["a", "bb", "ccc", "dddd"]  # judged at once, all four
        scorer.open("a")
        scorer.open("bb")
        # g1 has one verdict of two, g2 one of two: nothing whole yet.
        assert await judging.next_group(timeout_s=0.05) is None
        scorer.open("dddd")  # g2 is whole first
        g = await judging.next_group(timeout_s=1.0)
        assert g.group == "g2"
        assert [c.text for c in g.completions] == ["bb", "dddd"]  # by index
        assert [v.reward for v in g.verdicts] == [2.0, 4.0]
        scorer.open("ccc")
        g = await judging.next_group(timeout_s=1.0)
        assert g.group == "g1" and [c.text for c in g.completions] == ["ccc", "a"]
        # Nothing judging, nothing ready: without a timeout no wait at all.
        assert await judging.next_group() is None
        assert judging.unfinished() == {}

    asyncio.run(main())


def test_aborted_completions_are_not_judged_and_their_group_stays_unfinished():
    async def main():
        scorer = _GatedScorer()
        aborts = []
        judging = GroupJudging(scorer, _to_sample, group_size=3)
        assert judging.add(_Completion("a"), group=7) is True
        assert judging.add(_Completion("partial", finish_reason="abort"), group=7) is False
        assert judging.add(_Completion("ok"), group=7) is True
        await asyncio.sleep(0)
        assert "partial" not in scorer.seen and judging.num_aborted == 1

        def abort():  # the judge engine's abort: here it releases the waiting verdicts
            aborts.append(1)
            scorer.open("a")
            scorer.open("ok")

        await judging.drain(abort=abort)
        assert aborts and judging.num_judging == 0
        assert await judging.next_group() is None  # never whole: one sample was cut
        ((judged, aborted),) = judging.unfinished().values()
        assert sorted(judged) == [0, 2] and list(aborted) == [1]
        assert aborted[1].text == "partial"

    asyncio.run(main())


def test_with_a_genrm_the_verdicts_are_the_judges():
    # A real GenRM on a fake engine that says No to the response "xxx" only.
    parser = YesNoParser()
    judge = GenRM(
        FakeJudgeEngine(judge=lambda text, k: "No" if "r=xxx" in text else "Yes"),
        template=JudgeTemplate(user="r={response}"),
        parser=parser,
    )

    async def main():
        judging = GroupJudging(judge, _to_sample, group_size=2)
        for j, text in enumerate(["xx", "xxx"]):
            judging.add(_Completion(text), group="g", index=j)
        group = await judging.next_group(timeout_s=5.0)
        assert [v.reward for v in group.verdicts] == [parser.yes_reward, parser.no_reward]

    asyncio.run(main())


def test_a_scorer_that_raises_stops_the_wait():
    class Broken:
        async def ascore(self, samples):
            raise OSError("judge down")

    async def main():
        judging = GroupJudging(Broken(), _to_sample, group_size=1)
        judging.add(_Completion("a"), group=0)
        with pytest.raises(RuntimeError, match="judge down"):
            await judging.drain()

    asyncio.run(main())


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_group_size_is_refused(size):
    with pytest.raises(ValueError, match="group_size"):
        GroupJudging(_GatedScorer(), _to_sample, group_size=size)


def test_a_sample_added_twice_or_out_of_range_is_refused():
    async def main():
        judging = GroupJudging(_GatedScorer(), _to_sample, group_size=2)
        judging.add(_Completion("a"), group=0, index=0)
        with pytest.raises(ValueError, match="added twice"):
            judging.add(_Completion("b"), group=0, index=0)
        with pytest.raises(ValueError, match="group_size is 2"):
            judging.add(_Completion("c"), group=0, index=2)

    asyncio.run(main())
