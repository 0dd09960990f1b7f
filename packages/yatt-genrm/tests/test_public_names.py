"""The public names of yatt.genrm and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.genrm": [
        "AccuracySignal",
        "BatchingConfig",
        "CombinedRM",
        "CutGroup",
        "EnvReward",
        "ExactMatch",
        "GenRM",
        "GenRMClient",
        "GroupJudging",
        "JudgeSpec",
        "JudgeTemplate",
        "JudgedGroup",
        "JudgedStream",
        "NumericMatch",
        "OpenAIJudge",
        "OpenAIJudgeConfig",
        "RegexMatch",
        "RewardFunction",
        "RuleVerifier",
        "Sample",
        "ScoreParser",
        "ScoreStats",
        "ScoredCompletions",
        "Scorer",
        "ScoringStopped",
        "StreamedGroup",
        "TrajectoryReward",
        "Verdict",
        "VerdictParser",
        "Vote",
        "YesNoParser",
        "__version__",
        "build_judge",
        "check_judge_resources",
        "create_app",
        "load_reward_function",
        "load_reward_functions",
        "pointwise_template",
        "score_as_completed",
        "trajectory_sample",
        "trajectory_template",
        "verification_template",
        "JudgedSample",
        "generate_and_judge",
        "judge_in_rounds",
        "judge_prompts",
        "judge_trajectories",
        "judged_samples",
        "TrajectoryCompletion",
        "TrajectoryStream",
        "score_trajectories",
        "StepStats",
        "VerdictWarnings",
        "check_verdicts",
        "describe_failure",
    ],
    "yatt.genrm.serve": [
        "TEMPLATES",
        "build_genrm",
        "build_parser",
        "load_engine",
        "main",
    ],
    "yatt.genrm.testing": [
        "ByteTokenizer",
        "EngineCall",
        "FakeJudgeEngine",
        "RecordingScorer",
        "always_yes",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.genrm", PUBLIC_NAMES, __file__)
