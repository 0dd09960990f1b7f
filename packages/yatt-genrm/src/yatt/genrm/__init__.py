"""yatt.genrm: generative reward models that score rollouts as they finish."""

from yatt.genrm._as_completed import score_as_completed
from yatt.genrm._client import GenRMClient
from yatt.genrm._combine import CombinedRM
from yatt.genrm._genrm import GenRM
from yatt.genrm._parsers import ScoreParser, VerdictParser, YesNoParser
from yatt.genrm._server import create_app
from yatt.genrm._stream import BatchingConfig
from yatt.genrm._templates import JudgeTemplate, pointwise_template, verification_template
from yatt.genrm._types import Sample, Verdict, Vote
from yatt.genrm._verifiers import ExactMatch, NumericMatch, RegexMatch, RuleVerifier
from yatt.genrm._version import __version__

__all__ = [
    "BatchingConfig",
    "CombinedRM",
    "ExactMatch",
    "GenRM",
    "GenRMClient",
    "JudgeTemplate",
    "NumericMatch",
    "RegexMatch",
    "RuleVerifier",
    "Sample",
    "ScoreParser",
    "Verdict",
    "VerdictParser",
    "Vote",
    "YesNoParser",
    "__version__",
    "create_app",
    "pointwise_template",
    "score_as_completed",
    "verification_template",
]
