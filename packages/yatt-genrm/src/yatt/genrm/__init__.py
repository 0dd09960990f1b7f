"""yatt.genrm: generative reward models that score rollouts as they finish.

Per-call stats: every Verdict carries its status, error and the judge tokens spent on it, so a
call's own verdicts say what it cost and what went wrong, however many calls share the scorer:

    scored = await score_as_completed(engine.stream(requests, sampling), genrm, to_sample)
    completions, verdicts = scored      # still a 2-tuple
    scored.stats.num_errors, scored.stats.first_error
    scored.stats.num_unparsable, scored.stats.first_unparsable
    scored.stats.num_judge_prompt_tokens  # this call's judge load, no counter differencing
    ScoreStats.from_verdicts(genrm.score(samples))  # the same for a blocking call
    genrm.score(samples, should_stop=flag.is_set)   # ScoringStopped once the flag is set

Dynamic sampling in a stream: `GroupJudging` judges each finished completion at once, hands
back whole groups once all their samples are judged, and sets aborted completions aside:

    judging = GroupJudging(genrm, to_sample, group_size=8)
    judging.add(completion, group=key, index=j)      # as the engine yields it
    group = await judging.next_group(timeout_s=0.01) # whole, judged; None after the wait

Rewards without a judge model: `load_reward_function("my_module:score")` is a scorer of its own
and a rule for `CombinedRM(None, [(fn, weight), ...])`; yatt's per-sample form, TRL's batch form
and verl's compute_score are all taken, and `load_reward_functions(specs, weights=, forms=,
timeout_s=, num_workers=)` loads several onto one pool of worker processes. A judge served elsewhere (vLLM, SGLang,
a hosted model): `OpenAIJudge(OpenAIJudgeConfig(base_url=..., model=...), template=, parser=)`.
"""

from yatt.genrm._accuracy import AccuracySignal
from yatt.genrm._as_completed import ScoredCompletions, score_as_completed
from yatt.genrm._client import GenRMClient
from yatt.genrm._combine import CombinedRM
from yatt.genrm._functions import RewardFunction, load_reward_function, load_reward_functions
from yatt.genrm._genrm import GenRM
from yatt.genrm._groups import GroupJudging, JudgedGroup
from yatt.genrm._judge_build import build_judge, check_judge_resources
from yatt.genrm._judge_spec import JudgeSpec
from yatt.genrm._judged_round import (
    JudgedSample,
    generate_and_judge,
    judge_prompts,
    judged_samples,
)
from yatt.genrm._judged_rounds import judge_in_rounds
from yatt.genrm._judged_stream import CutGroup, JudgedStream, StreamedGroup
from yatt.genrm._openai import OpenAIJudge, OpenAIJudgeConfig
from yatt.genrm._parsers import ScoreParser, VerdictParser, YesNoParser
from yatt.genrm._server import create_app
from yatt.genrm._stats import ScoreStats
from yatt.genrm._step_stats import StepStats, VerdictWarnings, check_verdicts
from yatt.genrm._stopping import ScoringStopped
from yatt.genrm._stream import BatchingConfig
from yatt.genrm._templates import JudgeTemplate, pointwise_template, verification_template
from yatt.genrm._trajectory import (
    EnvReward,
    TrajectoryCompletion,
    TrajectoryReward,
    trajectory_sample,
    trajectory_template,
)
from yatt.genrm._trajectory_round import (
    judge_trajectories,
    score_trajectories,
)
from yatt.genrm._trajectory_stream import TrajectoryStream
from yatt.genrm._types import Sample, Scorer, Verdict, Vote, describe_failure
from yatt.genrm._verifiers import ExactMatch, NumericMatch, RegexMatch, RuleVerifier
from yatt.genrm._version import __version__

__all__ = [
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
    "JudgedSample",
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
    "StepStats",
    "StreamedGroup",
    "TrajectoryCompletion",
    "TrajectoryReward",
    "TrajectoryStream",
    "Verdict",
    "VerdictParser",
    "VerdictWarnings",
    "Vote",
    "YesNoParser",
    "__version__",
    "build_judge",
    "check_judge_resources",
    "check_verdicts",
    "create_app",
    "describe_failure",
    "generate_and_judge",
    "judge_in_rounds",
    "judge_prompts",
    "judge_trajectories",
    "judged_samples",
    "load_reward_function",
    "load_reward_functions",
    "pointwise_template",
    "score_as_completed",
    "score_trajectories",
    "trajectory_sample",
    "trajectory_template",
    "verification_template",
]
