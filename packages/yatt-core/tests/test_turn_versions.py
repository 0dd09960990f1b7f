"""A multi-turn trajectory's version per token (VersionRecordingEngine): each turn's sampled
tokens carry the version read when that turn's engine call started, the ids between turns the
version of the turn before them. Expected versions are written out by hand per token."""

NUM_GPUS = 0

import asyncio
from dataclasses import dataclass, field

import pytest

from yatt.core import VersionRecordingEngine, rollout_samples


@dataclass
class FakeRequest:
    prompt_ids: list[int]
    session_id: str | None = None


@dataclass
class FakeCompletion:
    request_index: int
    response_ids: list[int]


@dataclass
class FakeTrajectory:
    session_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"


class FakeEngine:
    """Answers each request with the next reply of its session's script."""

    tokenizer = "the engine's tokenizer"

    def __init__(self, replies: dict[str, list[list[int]]]) -> None:
        self.replies = replies
        self.num_closed = 0

    async def stream(self, requests, sampling):
        try:
            for i, request in enumerate(requests):
                await asyncio.sleep(0)
                yield FakeCompletion(i, self.replies[request.session_id].pop(0))
        finally:
            self.num_closed += 1

    def generate(self, requests, sampling):
        return [
            FakeCompletion(i, self.replies[r.session_id].pop(0)) for i, r in enumerate(requests)
        ]


async def _turn(engine, trajectory: FakeTrajectory, tool_ids: list[int]) -> None:
    """One turn as a multi-turn driver runs it: sample (mask 1), then the tool's ids (mask 0)."""
    request = FakeRequest(trajectory.prompt_ids + trajectory.response_ids, trajectory.session_id)
    stream = engine.stream([request], sampling=None)
    try:
        async for completion in stream:
            sampled = completion.response_ids
    finally:
        await stream.aclose()
    trajectory.response_ids += sampled + tool_ids
    trajectory.loss_mask += [1] * len(sampled) + [0] * len(tool_ids)
    trajectory.logprobs += [-0.5] * len(sampled) + [0.0] * len(tool_ids)


def test_the_version_moves_between_two_turns():
    engine = FakeEngine({"a": [[11, 12, 13], [14, 15]]})
    version = {"now": 3}
    recording = VersionRecordingEngine(engine, lambda: version["now"])
    trajectory = FakeTrajectory("a", prompt_ids=[1, 2])

    async def run() -> None:
        await _turn(recording, trajectory, tool_ids=[90, 91])  # under version 3
        version["now"] = 4  # weights pushed while the tool ran
        await _turn(recording, trajectory, tool_ids=[])

    asyncio.run(run())
    assert trajectory.response_ids == [11, 12, 13, 90, 91, 14, 15]
    versions = recording.token_versions(trajectory)
    #                   turn 1 sampled  tool ids  turn 2 sampled
    assert versions == [3, 3, 3, 3, 3, 4, 4]
    assert engine.num_closed == 2  # each turn's engine call closed
    # the trainer's sample: the prompt carries the first turn's version
    (sample,) = rollout_samples([trajectory], [1.0], [0], policy_versions=[versions])
    assert sample["policy_version"] == [3, 3, 3, 3, 3, 3, 3, 4, 4]
    with pytest.raises(RuntimeError, match="the calls noted for it sampled \\[\\]"):
        recording.token_versions(trajectory)  # read once: the notes are forgotten


def test_interleaved_sessions_and_an_empty_turn_keep_their_own_versions():
    engine = FakeEngine({"a": [[11, 12], [], [13]], "b": [[21], [22, 23]]})
    version = {"now": 0}
    recording = VersionRecordingEngine(engine, lambda: version["now"])
    a = FakeTrajectory("a", prompt_ids=[1])
    b = FakeTrajectory("b", prompt_ids=[1])

    async def run() -> None:
        await _turn(recording, a, tool_ids=[90])  # a1 at 0
        await _turn(recording, b, tool_ids=[91, 92])  # b1 at 0
        version["now"] = 2
        await _turn(recording, a, tool_ids=[93])  # a2 at 2: sampled nothing
        version["now"] = 5
        await _turn(recording, b, tool_ids=[])  # b2 at 5
        await _turn(recording, a, tool_ids=[])  # a3 at 5

    asyncio.run(run())
    assert a.response_ids == [11, 12, 90, 93, 13]
    assert recording.token_versions(a) == [0, 0, 0, 0, 5]
    assert b.response_ids == [21, 91, 92, 22, 23]
    assert recording.token_versions(b) == [0, 0, 0, 5, 5]


def test_generate_is_recorded_and_other_attributes_are_the_engines():
    engine = FakeEngine({"a": [[11, 12]]})
    recording = VersionRecordingEngine(engine, lambda: 7)
    (completion,) = recording.generate([FakeRequest([1], "a")], sampling=None)
    trajectory = FakeTrajectory("a", [1], completion.response_ids, [1, 1])
    assert recording.token_versions(trajectory) == [7, 7]
    assert recording.tokenizer == "the engine's tokenizer"


def test_a_turn_that_did_not_go_through_the_engine_is_an_error():
    engine = FakeEngine({"a": [[11, 12]]})
    recording = VersionRecordingEngine(engine, lambda: 0)
    recording.generate([FakeRequest([1], "a")], sampling=None)
    trajectory = FakeTrajectory("a", [1], [11, 12, 90, 13], [1, 1, 0, 1])
    with pytest.raises(RuntimeError, match=r"3 sampled tokens, but the calls noted .* \[2\]"):
        recording.token_versions(trajectory)


def test_a_request_without_a_session_passes_through_unnoted():
    engine = FakeEngine({None: [[11]], "a": [[12]]})
    recording = VersionRecordingEngine(engine, lambda: 0)
    recording.generate([FakeRequest([1], None), FakeRequest([1], "a")], sampling=None)
    trajectory = FakeTrajectory("a", [1], [12], [1])
    assert recording.token_versions(trajectory) == [0]
