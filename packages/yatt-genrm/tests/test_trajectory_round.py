"""score_trajectories and TrajectoryCompletion: a multi-turn trajectory's reward is the
scorer's plus env_reward_weight x the environment's, and it trains as a Completion whose loss
mask is its own."""

NUM_GPUS = 0

from types import SimpleNamespace

from yatt import genrm
from yatt.genrm.testing import RecordingScorer
from yatt.rollout import Trajectory


def _trajectory(row_index: int, sample_index: int, env_reward: float | None) -> Trajectory:
    return Trajectory(
        row_index=row_index,
        sample_index=sample_index,
        env_name="Guess",
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        loss_mask=[1, 0, 1],
        logprobs=[-0.5, 0.0, -0.25],
        messages=[
            {"role": "user", "content": "guess"},
            {"role": "assistant", "content": "5"},
        ],
        tool_calls=[[]],
        num_turns=1,
        end_cause="stop",
        env_reward=env_reward,
    )


def _scorer() -> RecordingScorer:
    """Reward 1 when the reference is "5" (what the sample reads of the row), else -1."""
    return RecordingScorer(lambda s: 1.0 if s.reference == "5" else -1.0, component="rewards:f")


PROMPTS = [SimpleNamespace(row={"secret": 5}), SimpleNamespace(row={"secret": 3})]


def test_the_reward_is_the_scorers_plus_the_weighted_environment_reward():
    trajectories = [_trajectory(0, 0, 1.0), _trajectory(1, 0, None)]
    scorer = _scorer()
    judged = genrm.score_trajectories(
        trajectories, PROMPTS, scorer, answer_key="secret", env_reward_weight=0.5
    )
    # 1 + 0.5 x 1 for row 0; -1 + 0.5 x 0 (no environment reward) for row 1
    assert [j.verdict.reward for j in judged] == [1.5, -1.0]
    assert [j.verdict.components for j in judged] == [
        {"rewards:f": 1.0, "env_reward": 1.0},
        {"rewards:f": -1.0, "env_reward": None},
    ]
    assert [s.reference for s in scorer.samples] == ["5", "3"]  # the row's answer, as text
    assert [j.prompt for j in judged] == PROMPTS
    completion = judged[0].completion
    assert completion.request_index == 0 and completion.sample_index == 0
    assert completion.loss_mask == [1, 0, 1] and completion.response_ids == [3, 4, 5]
    assert completion.finish_reason == "stop"


def test_without_a_scorer_the_environment_alone_is_the_reward():
    judged = genrm.score_trajectories(
        [_trajectory(0, 1, 0.25)], PROMPTS, None, answer_key="", env_reward_weight=2.0
    )
    (item,) = judged
    assert item.verdict.reward == 0.5 and item.verdict.status == "ok"
    assert item.sample.reference is None


class _MultiTurn:
    """MultiTurnRollout's run(): row 0 gives two trajectories, row 1 one (its second reset
    failed); notes the plan's phase and the rows it ran."""

    def __init__(self, plan) -> None:
        self.plan, self.rows, self.phases = plan, [], []

    async def run(self, rows, sampling):
        self.rows.extend(rows)
        self.phases.append(self.plan.current_phase)
        trajectories = [_trajectory(0, 0, 1.0), _trajectory(0, 1, 0.0), _trajectory(1, 0, 1.0)]
        return trajectories, "the round's stats"


class _Plan:
    phases = ("rollout", "genrm", "train")
    current_phase = None

    def phase(self, name):
        import contextlib

        @contextlib.contextmanager
        def entered():
            self.current_phase = name
            try:
                yield
            finally:
                self.current_phase = None

        return entered()


def test_a_multiturn_round_runs_in_the_rollout_phase_judges_in_genrm_and_keeps_whole_groups():
    from yatt import rollout

    plan, timings = _Plan(), {}
    multiturn, scorer = _MultiTurn(plan), _scorer()
    scorer_phases = []
    score = scorer.score
    scorer.score = lambda samples, **kw: (
        scorer_phases.append(plan.current_phase) or score(samples, **kw)
    )
    judged, stats = genrm.judge_trajectories(
        multiturn,
        [{"prompt": "a"}, {"prompt": "b"}],
        PROMPTS,
        rollout.SamplingParams(n=2, max_new_tokens=4),
        scorer=scorer,
        plan=plan,
        timings=timings,
        answer_key="secret",
        env_reward_weight=1.0,
    )
    assert multiturn.rows == [{"prompt": "a"}, {"prompt": "b"}]
    assert (multiturn.phases, scorer_phases) == (["rollout"], ["genrm"])
    assert set(timings) == {"rollout", "genrm"} and stats == "the round's stats"
    # row 1 has one trajectory of n=2: its group is dropped; row 0's rewards 1 + 1, 1 + 0
    assert [(j.completion.request_index, j.verdict.reward) for j in judged] == [(0, 2.0), (0, 1.0)]


def test_a_stop_flag_reaches_the_trajectories_scorer():
    # issue 49: a stop signal while the judge works ends the multi-turn round too
    import pytest

    trajectories = [_trajectory(0, 0, 1.0)]
    with pytest.raises(genrm.ScoringStopped):
        genrm.score_trajectories(
            trajectories,
            PROMPTS,
            _scorer(),  # ScoringStopped once should_stop is true
            answer_key="secret",
            env_reward_weight=1.0,
            should_stop=lambda: True,
        )
