"""TrajectoryStream: under partial colocation each multi-turn trajectory is judged as soon as it
ends, while others are still in their tool loops; groups come back whole; the long tail is cut
once the sampler is full (counted); a stop signal ends the stream; and the rewards equal the
round path's (judge after the rollout) on the same scripted engine."""

NUM_GPUS = 0

import asyncio
import threading
from types import SimpleNamespace

import pytest

from yatt import genrm, rollout
from yatt.placement import PendingLoad
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE
from yatt.testing import make_tokenizer

CALL = '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'
# Set by the judge at its first verdict; a `wait` told to block waits for it (a thread of the
# tool runner), so a trajectory that blocks cannot end before some verdict exists.
FIRST_VERDICT = threading.Event()
RELEASE = threading.Event()  # never set by the code under test: a tail that never ends


class WaitEnv:
    """A row's environment: `wait` blocks as the row says; get_reward = 0.5 x its calls."""

    def reset(self, **row):
        if row.get("bad"):
            raise RuntimeError("this row cannot be reset")
        self.block = row.get("block", "")
        self.num_calls = 0
        return None

    def wait(self) -> str:
        """Wait for the world to change."""
        self.num_calls += 1
        if self.block == "verdict":
            return "ok" if FIRST_VERDICT.wait(timeout=5) else "no verdict came"
        if self.block == "forever":
            RELEASE.wait(timeout=5)
        return "ok"

    def get_reward(self) -> float:
        return 0.5 * self.num_calls


class _Engine:
    """Sample j of row r calls `wait` plan[r][j][0] times, then answers plan[r][j][1]; every
    turn is recorded in `events` as ("turn", row, sample, turn)."""

    def __init__(self, tokenizer, plan, events) -> None:
        self.tokenizer, self.plan, self.events = tokenizer, plan, events
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def stream(self, requests, sampling):
        for request in requests:
            row, sample, turn = (int(x) for x in request.request_id.split("/"))
            await asyncio.sleep(0)
            num_calls, answer = self.plan[row][sample]
            text = CALL if turn < num_calls else answer
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end_id]
            self.events.append(("turn", row, sample, turn))
            yield rollout.Completion(
                request_index=0,
                sample_index=0,
                prompt_ids=list(request.prompt_ids),
                response_ids=ids,
                logprobs=[-0.125] * len(ids),
                finish_reason="stop",
                request_id=request.request_id,
            )


class _Judge:
    """Reward 1 for a transcript ending in "yes", else 0; each verdict recorded in `events`
    as ("judged", row id, its last answer)."""

    def __init__(self, events) -> None:
        self.events = events

    def _verdicts(self, samples):
        out = []
        for sample in samples:
            self.events.append(("judged", sample.metadata["row"]["id"]))
            reward = 1.0 if sample.response.endswith("yes") else 0.0
            out.append(
                genrm.Verdict(
                    sample_id=sample.id,
                    reward=reward,
                    status="ok",
                    components={"judge": reward},
                )
            )
        FIRST_VERDICT.set()
        return out

    async def ascore(self, samples):
        await asyncio.sleep(0)
        return self._verdicts(samples)

    def score(self, samples, *, should_stop=None):
        return self._verdicts(samples)


class _Sampler:
    """Asks for `draws` in turn (then 0); full once `target` groups were kept."""

    def __init__(self, draws, target) -> None:
        self.draws, self.target = list(draws), target
        self.kept: list[list[genrm.JudgedSample]] = []

    def num_to_draw(self, *, in_flight: int) -> int:
        return self.draws.pop(0) if self.draws else 0

    def should_abort(self) -> bool:
        return len(self.kept) >= self.target

    def keep(self, group) -> None:  # DAPO: only groups whose reward varies
        if len({j.verdict.reward for j in group}) > 1:
            self.kept.append(group)


def _setup(plan, **env):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    events: list[tuple] = []
    engine = _Engine(tokenizer, plan, events)
    config = rollout.EnvConfig(max_turns=6, max_trajectory_tokens=4000, tool_timeout_s=10, **env)
    multiturn = rollout.MultiTurnRollout(engine, config, environments=[WaitEnv])
    return multiturn, _Judge(events), events


def _rows(*blocks, bad=()):
    return [
        {"prompt": f"row {i}", "id": i, "block": block, "bad": i in bad}
        for i, block in enumerate(blocks)
    ]


def _stream(multiturn, judge, *, n=2, load=None):
    return genrm.TrajectoryStream(
        multiturn=multiturn,
        scorer=judge,
        sampling=rollout.SamplingParams(n=n, max_new_tokens=64, seed=3),
        to_row=lambda row: row,
        answer_key="",
        env_reward_weight=1.0,
        load=load,
    )


@pytest.fixture(autouse=True)
def _events():
    FIRST_VERDICT.clear()
    RELEASE.clear()
    yield
    RELEASE.set()  # a tool thread still waiting ends now


def test_the_first_verdict_arrives_while_a_long_trajectory_is_still_in_its_tool_loop():
    # row 0 answers at once; row 1's sample 0 calls `wait` 3 times, each call blocking until
    # some verdict exists (at most 5 s): judged after the rollout it would find none.
    plan = {0: [(0, "yes"), (0, "no")], 1: [(3, "yes"), (0, "no")]}
    multiturn, judge, events = _setup(plan)
    rows = _rows("", "verdict")

    judged = asyncio.run(_stream(multiturn, judge).judge_all(rows))

    first_verdict = events.index(("judged", 0))
    last_turn = events.index(("turn", 1, 0, 3))
    assert first_verdict < last_turn  # judged while row 1 still had turns to go
    # groups whole, by (row, sample); the long one saw the verdict, not a timeout
    assert [(j.completion.request_index, j.completion.sample_index) for j in judged] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    long = judged[2].completion.trajectory
    assert [m["content"] for m in long.messages if m["role"] == "tool"] == ["ok"] * 3
    # reward = judge + 1.0 x get_reward (0.5 per call)
    assert [j.verdict.reward for j in judged] == [1.0, 0.0, 2.5, 0.0]
    assert judged[2].verdict.components == {"judge": 1.0, "env_reward": 1.5}


def test_rewards_equal_the_round_path_and_a_row_whose_reset_failed_is_dropped():
    plan = {
        0: [(1, "yes"), (0, "no")],
        1: [(2, "no"), (1, "yes")],
        2: [(0, "yes"), (0, "yes")],
        3: [(0, "yes"), (0, "no")],
    }
    rows = _rows("", "", "", "", bad=(2,))
    sampling = rollout.SamplingParams(n=2, max_new_tokens=64, seed=3)

    class _Plan:
        phases = ("rollout", "genrm", "train")
        has_memory_split = False

        def phase(self, name):
            import contextlib

            return contextlib.nullcontext()

    results = {}
    for should_overlap in (False, True):
        multiturn, judge, _ = _setup(plan)
        timings = {}
        judged, stats = genrm.judge_trajectories(
            multiturn,
            rows,
            [SimpleNamespace(row=row, name=f"prompt {i}") for i, row in enumerate(rows)],
            sampling,
            scorer=judge,
            plan=_Plan(),
            timings=timings,
            answer_key="",
            env_reward_weight=1.0,
            should_overlap=should_overlap,
        )
        results[should_overlap] = [
            (
                j.completion.request_index,
                j.completion.sample_index,
                j.verdict.reward,
                j.verdict.components,
                j.completion.response_ids,
                j.completion.loss_mask,
                j.prompt.name,
            )
            for j in judged
        ]
        assert stats.num_reset_errors == 2  # row 2's two samples
        assert set(timings) == ({"rollout+genrm"} if should_overlap else {"rollout", "genrm"})
    assert results[True] == results[False]
    # by hand: judge (ends in "yes") + 0.5 per `wait` call; row 2 dropped
    assert [r[:3] for r in results[True]] == [
        (0, 0, 1.5),
        (0, 1, 0.0),
        (1, 0, 1.0),
        (1, 1, 1.5),
        (3, 0, 1.0),
        (3, 1, 0.0),
    ]
    assert [r[6] for r in results[True]] == ["prompt 0"] * 2 + ["prompt 1"] * 2 + ["prompt 3"] * 2


class _RecordingLoad(PendingLoad):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[float, float]] = []

    def record(self, now, *, rollout_tokens, genrm_tokens) -> None:
        self.records.append((rollout_tokens, genrm_tokens))
        super().record(now, rollout_tokens=rollout_tokens, genrm_tokens=genrm_tokens)


def test_the_tail_is_cut_once_full_and_the_cut_group_is_counted():
    # row 0: no variance (handed back, not kept); row 1: variance (kept: full);
    # row 2: sample 0 blocks in its tool until the cut; sample 1 ends at once.
    plan = {0: [(0, "no"), (0, "no")], 1: [(1, "yes"), (0, "no")], 2: [(2, "yes"), (0, "no")]}
    multiturn, judge, events = _setup(plan)
    rows = iter(_rows("", "", "forever"))
    sampler = _Sampler(draws=[3], target=1)
    load = _RecordingLoad()
    stream = _stream(multiturn, judge, load=load)

    asyncio.run(
        stream.run(sampler, draw=lambda k: [next(rows) for _ in range(k)], keep=sampler.keep)
    )

    assert [[j.completion.request_index for j in g] for g in sampler.kept] == [[1, 1]]
    assert stream.num_groups_cut == 1 and stream.num_in_flight == 0
    assert ("turn", 2, 0, 1) not in events  # its second turn never started
    # the cut group's finished trajectory (row 2, sample 1) is what its tokens count
    assert stream.turn_stats.num_trajectories == 5
    assert stream.num_cut_tokens == len(multiturn.tokenizer.encode("no")) + 1  # + <|im_end|>
    stats = stream.stats()
    assert stats["num_groups_cut"] == 1.0 and stats["num_groups_incomplete"] == 0.0
    # the live queues: 3 rows x 2 trajectories x 4000 tokens owed at the feed, none at the end
    assert load.records[0][0] == 3 * 2 * 4000 and load.records[-1] == (0, 0)
    assert set(stream.pending_tokens()) == {"rollout_pending_tokens", "genrm_pending_tokens"}


def test_a_stop_signal_mid_stream_ends_it_and_counts_what_it_cut():
    plan = {0: [(0, "yes"), (0, "no")], 1: [(2, "yes"), (0, "no")]}
    multiturn, judge, _ = _setup(plan)
    rows = iter(_rows("", "forever"))
    sampler = _Sampler(draws=[2], target=10)  # never full: only the stop ends it
    stream = _stream(multiturn, judge)

    asyncio.run(
        stream.run(
            sampler,
            draw=lambda k: [next(rows) for _ in range(k)],
            keep=sampler.keep,
            should_stop=lambda: bool(sampler.kept),  # set once the first group is kept
        )
    )
    assert len(sampler.kept) == 1 and stream.num_groups_cut == 1

    # the round form: ScoringStopped once row 0 is judged whole, nothing kept
    multiturn, judge, _ = _setup(plan)
    stream = _stream(multiturn, judge)
    with pytest.raises(genrm.ScoringStopped):
        asyncio.run(
            stream.judge_all(_rows("", "forever"), should_stop=lambda: stream.num_in_flight < 2)
        )
    assert stream.num_groups_cut == 1


def test_an_engine_error_is_raised_not_waited_on():
    class _Broken:
        tokenizer = make_tokenizer()

        async def stream(self, requests, sampling):
            raise RuntimeError("the engine died")
            yield  # an async generator

    _Broken.tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    multiturn = rollout.MultiTurnRollout(
        _Broken(), rollout.EnvConfig(max_trajectory_tokens=4000), environments=[WaitEnv]
    )
    stream = _stream(multiturn, _Judge([]))
    with pytest.raises(RuntimeError, match="the engine died"):
        asyncio.run(stream.judge_all(_rows("")))
