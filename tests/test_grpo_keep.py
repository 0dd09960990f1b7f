"""The trainer's keep path through its own step function (train_grpo.rollout_in_rounds) with a
real reward function in a worker process: a row the reward cannot judge is dropped as a data
skip (issue 49), per-function reward metrics are logged and accuracy comes only from the
declared signal (issue 46). The engine, tokenizer and loader are small fakes; the reward, its
worker, the sampler and the metrics are the real ones."""

NUM_GPUS = 0

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_grpo
from grpo_metrics import StepStats, VerdictWarnings, check_verdicts, summarize

from yatt import core, genrm, rollout

SAMPLES_PER_PROMPT = 4
# A verl-style dict return: the score, and the 0/1 signal reward.accuracy may name.
REWARDS = """
def score(prompt, response, reference, row):
    right = float(response == reference)
    return {"score": 2 * right - 1, "acc": right}
"""


def _deep_row() -> dict:
    """A row nested deeper than pickle can go: it cannot be sent to a reward worker
    (packages/yatt-genrm/tests/test_reward_forms.py builds its sample the same way)."""
    nested: dict = {}
    node = nested
    for _ in range(2 * sys.getrecursionlimit()):
        node["a"] = {}
        node = node["a"]
    return {"prompt": "2+2=", "answer": "4", "x": nested}


class _Prompt:
    def __init__(self, row: dict) -> None:
        self.row, self.images, self.vision = row, None, None

    def request(self) -> rollout.Request:
        return rollout.Request(prompt_ids=[1, 2, 3])


class _Engine:
    """Sample j of every request answers "4" when j is even, "5" when odd: half right."""

    def generate(self, requests, sampling):
        return [
            rollout.Completion(
                request_index=i,
                sample_index=j,
                prompt_ids=list(request.prompt_ids),
                response_ids=[4 if j % 2 == 0 else 5],
                logprobs=[-0.5],
                finish_reason="stop",
            )
            for i, request in enumerate(requests)
            for j in range(sampling.n)
        ]


class _Loader:
    rank, num_local_rows = 0, 3

    def __init__(self, rows: list[dict]) -> None:
        self.rows, self.position = rows, 0

    def next_batch(self, num_rows: int) -> list[dict]:
        out = [self.rows[(self.position + i) % len(self.rows)] for i in range(num_rows)]
        self.position += num_rows
        return out


class _Encoder:
    takes_images, cut_token_ids = False, ()

    def encode(self, rows):
        return [_Prompt(row) for row in rows]

    def skipped_by_cause(self, loader) -> dict[str, int]:
        return {"no_prompt": 0}


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    function = genrm.load_reward_function(f"{path}:score", timeout_s=30.0)
    yield function
    function.close()


def _context(scorer, accuracy: genrm.AccuracySignal | None) -> train_grpo.RolloutContext:
    from yatt.placement import Plan
    from yatt.placement.testing import RecordingRole

    roles = {name: RecordingRole(name, [], {"weights": 1}) for name in ("rollout", "train")}
    cfg = SimpleNamespace(
        seed=0,
        data=SimpleNamespace(prompt_key="prompt", answer_key="answer"),
        overlong=core.OverlongConfig(),
        rollout=SimpleNamespace(
            samples_per_prompt=SAMPLES_PER_PROMPT,
            temperature=1.0,
            max_new_tokens=4,
            sampling_knobs=dict,
        ),
    )
    rows = [{"prompt": "2+2=", "answer": "4"}, _deep_row(), {"prompt": "1+3=", "answer": "4"}]
    return train_grpo.RolloutContext(
        cfg=cfg,
        runtime=core.init_runtime(seed=0),
        loader=_Loader(rows),
        encoder=_Encoder(),
        tokenizer=SimpleNamespace(decode=lambda ids, **_: "".join(str(i) for i in ids)),
        engine=_Engine(),
        judge_engine=None,
        scorer=scorer,
        accuracy=accuracy,
        plan=Plan.full_colocation(**roles),
        # 2 groups wanted, 3 drawn in the first round (oversample 1.5): one row is unjudgeable
        sampler=core.DynamicSampler(
            target_groups=2, oversample=1.5, max_oversample=1.5, reward_key=train_grpo.TASK_REWARD
        ),
        partials=None,
        should_overlap=False,
    )


def _step(ctx) -> tuple[core.Batch, dict[str, float]]:
    stats = StepStats()
    batch, sampling_stats = train_grpo.rollout_in_rounds(0, ctx, stats)
    metrics = summarize(
        stats, sampling_stats, ctx.skipped_by_cause(), None, has_accuracy=ctx.accuracy is not None
    )
    return batch, metrics


def test_an_unjudgeable_row_is_a_counted_data_skip_never_trained(scorer, caplog):
    name = scorer.name  # "rewards:score"
    ctx = _context(scorer, genrm.AccuracySignal(f"{name}/acc"))
    with caplog.at_level(logging.WARNING, logger="train_grpo"):
        batch, metrics = _step(ctx)
    # The deep row's 4 responses got the default reward with a skip_cause: dropped whole.
    assert ctx.num_unjudgeable_rows == 1
    assert metrics["data/skipped_rows/unjudgeable"] == 1.0
    assert metrics["data/skipped_rows"] == 1.0
    assert "cannot be sent to a worker process" in caplog.text
    # The two good rows train, each a whole group; none of the skipped row's samples.
    assert len(batch) == 2 * SAMPLES_PER_PROMPT
    assert len(set(batch.samples["group_id"].tolist())) == 2
    assert batch.samples["reward"].tolist() == [1.0, -1.0] * 4  # the function's, never 0
    assert metrics["genrm/verdicts"] == 8 and metrics["genrm/errors"] == 0
    # Per reward function over the kept responses, by hand: scores +-1 half each -> mean 0,
    # population std 1; its returned "acc" key half right.
    assert metrics[f"reward/{name}/mean"] == 0.0
    assert metrics[f"reward/{name}/std"] == 1.0
    assert metrics[f"reward/{name}/acc/mean"] == 0.5
    # Accuracy from the declared signal (the function's "acc"), not from the reward (mean 0).
    assert metrics["reward/accuracy"] == 0.5 and metrics["reward/mean"] == 0.0
    assert metrics["reward/accuracy_missing"] == 0.0


def test_without_a_declared_signal_there_is_no_accuracy_metric(scorer):
    _, metrics = _step(_context(scorer, None))
    assert "reward/accuracy" not in metrics and "reward/accuracy_missing" not in metrics
    assert metrics["reward/mean"] == 0.0


def test_a_declared_signal_no_verdict_carries_is_counted_and_logged_once(scorer, caplog):
    _, metrics = _step(_context(scorer, genrm.AccuracySignal("rewards:nope/acc")))
    assert metrics["reward/accuracy_missing"] == 8.0  # every kept response, not a silent 0
    warnings = VerdictWarnings(accuracy="rewards:nope/acc")
    with caplog.at_level(logging.WARNING, logger="train_grpo"):
        check_verdicts(0, metrics, None, warnings)
        check_verdicts(1, metrics, None, warnings)
    assert caplog.text.count("reward.accuracy='rewards:nope/acc'") == 1


_TWO_RANKS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from grpo_metrics import StepStats, summarize
from yatt import genrm, rollout

dist.init_process_group("gloo")
rank = dist.get_rank()
stats = StepStats()
# rank 0's function f scored 1 and 3, rank 1's scored 5; only rank 1 has g and a returned key
components = [{"f": 1.0}, {"f": 3.0}] if rank == 0 else [{"f": 5.0, "g": 2.0}]
judged = [
    genrm.JudgedSample(
        rollout.Completion(request_index=0, sample_index=j, prompt_ids=[1], response_ids=[2],
                           logprobs=[0.0], finish_reason="stop"),
        genrm.Sample(prompt="q", response="r"),
        genrm.Verdict(sample_id="s", reward=0.0, status="ok", components=c,
                      metrics={"g/acc": 1.0} if "g" in c else {}),
        type("P", (), {"images": None})(),
    )
    for j, c in enumerate(components)
]
stats.add(judged, None)
metrics = summarize(stats, {}, {}, None)
print(json.dumps({k: v for k, v in metrics.items() if k.startswith("reward/")}))
dist.destroy_process_group()
"""


def test_per_function_metrics_agree_over_ranks_that_saw_different_functions(tmp_path):
    import json

    from yatt.testing import run_ranks

    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    outputs = run_ranks([sys.executable, str(script), str(ROOT / "examples")], 2)
    first, second = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert first == second
    # f over both ranks: values 1, 3, 5 -> mean 3, population std sqrt(8/3)
    assert first["reward/f/mean"] == pytest.approx(3.0)
    assert first["reward/f/std"] == pytest.approx((8 / 3) ** 0.5)
    assert first["reward/g/mean"] == 2.0 and first["reward/g/std"] == 0.0
    assert first["reward/g/acc/mean"] == 1.0
