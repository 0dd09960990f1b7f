"""Reward functions in TRL's and verl's forms on their own data, concurrent calls, dict returns
and per-function metrics."""

NUM_GPUS = 0

import asyncio
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from yatt.genrm import (
    CombinedRM,
    RewardFunction,
    Sample,
    ScoreStats,
    load_reward_function,
    load_reward_functions,
)

pytestmark = pytest.mark.timeout(120)

PEER_REWARDS_PY = '''
import asyncio
import re
import time

import numpy as np


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward: GSM8K's '#### answer' convention, a dict with extra metrics."""
    if data_source != "openai/gsm8k":
        return 0.0
    match = re.search(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    answer = match.group(1).replace(",", "") if match else None
    correct = answer == ground_truth
    return {"score": float(correct), "acc": correct, "pred": answer, "split": extra_info["split"]}


def verl_plain(data_source, solution_str, ground_truth, extra_info):
    return np.float32(len(solution_str) > 3)


def format_reward(completions, **kwargs):
    """TRL's batch form over conversational completions."""
    pattern = r"^<think>.*?</think>"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


def accuracy_reward(prompts, completions, solution, **kwargs):
    """TRL's batch form with a dataset column (solution), None where it cannot judge."""
    return [None if s is None else float(c == s) for c, s in zip(completions, solution)]


def short_list(prompts, completions, **kwargs):
    return [1.0]


def isclose(prompt, response, reference, row):
    return np.isclose(float(response), float(reference))  # a np.bool_


def slow(prompt, response, reference, row):
    time.sleep(0.05)
    return 1.0


async def slow_async(prompt, response, reference, row):
    await asyncio.sleep(0.05)
    return 1.0


def no_score_key(prompt, response, reference, row):
    return {"acc": 1.0}
'''


@pytest.fixture
def peer_file(tmp_path: Path) -> Path:
    path = tmp_path / "peer_rewards.py"
    path.write_text(PEER_REWARDS_PY)
    return path


def _gsm8k_row(index: int, answer: str) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "user", "content": "Natalia sold 48 clips... Let's think step by step"}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "answer": "...", "question": "..."},
    }


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in_process", "worker"])
def test_verl_compute_score_on_a_gsm8k_row(peer_file, timeout_s) -> None:
    fn = load_reward_function(f"{peer_file}:compute_score", timeout_s=timeout_s)
    assert fn.form == "verl"  # by its parameter names; it binds as yatt's 4 positional too
    samples = [
        # The answer key is verl's nested field: the reference is None, the row has it.
        Sample(prompt="q", response="so #### 72", metadata=_gsm8k_row(0, "72")),
        Sample(prompt="q", response="so #### 1,000", metadata=_gsm8k_row(1, "1000")),
        Sample(prompt="q", response="so #### 7", reference="72", metadata=_gsm8k_row(2, "x")),
        Sample(
            prompt="q", response="#### 72", metadata={**_gsm8k_row(3, "72"), "data_source": "o"}
        ),
    ]
    try:
        verdicts = fn.score(samples)
    finally:
        fn.close()
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0, 0.0]
    assert [v.status for v in verdicts] == ["ok"] * 4
    # "acc" (a bool) is a metric; "pred" (a str) and "split" are not numbers: left out.
    assert verdicts[0].metrics == {"peer_rewards:compute_score/acc": 1.0}
    assert verdicts[3].metrics == {}
    stats = ScoreStats.from_verdicts(verdicts)
    assert stats.reward_metrics["peer_rewards:compute_score/mean"] == 0.5
    assert stats.reward_metrics["peer_rewards:compute_score/std"] == 0.5
    assert stats.reward_metrics["peer_rewards:compute_score/acc/mean"] == pytest.approx(2 / 3)


def test_verl_form_is_never_fed_the_prompt_as_data_source(peer_file) -> None:
    fn = load_reward_function(f"{peer_file}:verl_plain")
    (verdict,) = fn.score([Sample(prompt="p", response="long enough", reference="r")])
    assert (fn.form, verdict.reward) == ("verl", 1.0)  # np.float32 accepted


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in_process", "worker"])
def test_trl_batch_form_on_a_conversational_dataset(peer_file, timeout_s) -> None:
    functions = load_reward_functions(
        [f"{peer_file}:format_reward", f"{peer_file}:accuracy_reward"], timeout_s=timeout_s
    )
    (fmt, _), (acc, _) = functions
    assert (fmt.form, acc.form) == ("trl", "trl")
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"},
        {"prompt": [{"role": "user", "content": "3+3?"}], "solution": "6"},
        {"prompt": [{"role": "user", "content": "?"}]},  # no solution: TRL passes None
    ]
    responses = ["<think>ok</think>4", "6", "<think>x</think>"]
    samples = [
        Sample(prompt="p", response=r, metadata=row) for r, row in zip(responses, rows, strict=True)
    ]
    try:
        assert [v.reward for v in fmt.score(samples)] == [1.0, 0.0, 1.0]
        verdicts = acc.score(samples)
        combined = CombinedRM(None, [(fmt, 1.0), (acc, 2.0)])
        summed = asyncio.run(combined.ascore(samples))
    finally:
        for function, _ in functions:
            function.close()
    # Conversational completions are message lists (TRL's shape), never equal to a str; the
    # row without a solution column gets None, and the function's None is "unparsable".
    assert [(v.status, v.reward) for v in verdicts] == [
        ("ok", 0.0),
        ("ok", 0.0),
        ("unparsable", 0.0),
    ]
    assert [v.reward for v in summed] == [1.0, 0.0, 1.0]


def test_trl_form_with_text_prompts_and_a_wrong_length_return(peer_file) -> None:
    acc = load_reward_function(f"{peer_file}:accuracy_reward")
    samples = [
        Sample(prompt="2+2?", response=r, metadata={"solution": s})
        for r, s in (("4", "4"), ("5", "6"))
    ]
    assert [v.reward for v in acc.score(samples)] == [1.0, 0.0]
    short = load_reward_function(f"{peer_file}:short_list")
    verdicts = short.score(samples)
    assert [v.status for v in verdicts] == ["error", "error"]
    assert "returned a list of 1 for a batch of 2 samples" in verdicts[0].error


def test_the_form_is_chosen_by_name_or_config_never_by_parameter_count() -> None:
    def four(a, b, c, d):
        return 1.0

    def verl_like(data_source, solution_str, ground_truth, extra_info):
        return 1.0

    assert RewardFunction(four).form == "sample"
    assert RewardFunction(verl_like).form == "verl"
    # An explicit form is checked against the signature.
    with pytest.raises(ValueError, match=r"cannot be called as fn\(prompts, completions"):
        RewardFunction(four, form="trl")
    with pytest.raises(ValueError, match=r"form='batch': use one of"):
        RewardFunction(four, form="batch")

    def two(prompt, response):
        return 1.0

    with pytest.raises(ValueError, match=r"set its form"):
        RewardFunction(two)


def test_numpy_scalars_are_rewards(peer_file) -> None:
    fn = load_reward_function(f"{peer_file}:isclose", timeout_s=30.0)
    try:
        verdicts = fn.score([Sample(prompt="p", response=r, reference="1.0") for r in "12"])
    finally:
        fn.close()
    assert [(v.status, v.reward) for v in verdicts] == [("ok", 1.0), ("ok", 0.0)]
    in_process = load_reward_function(f"{peer_file}:isclose")
    assert in_process.score([Sample(prompt="p", response="1", reference="1")])[0].reward == 1.0
    assert isinstance(np.isclose(1.0, 1.0), np.bool_)


def test_a_dict_without_score_is_an_error_saying_so(peer_file) -> None:
    fn = load_reward_function(f"{peer_file}:no_score_key")
    (verdict,) = fn.score([Sample(prompt="p", response="r")])
    assert verdict.status == "error" and "without a 'score' key" in verdict.error


@pytest.mark.parametrize("name", ["slow", "slow_async"])
@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in_process", "worker"])
def test_a_50ms_reward_over_64_samples_runs_concurrently(peer_file, name, timeout_s) -> None:
    """64 x 50 ms = 3.2 s one at a time; 8 at once is 0.4 s. The bound leaves room for a
    loaded 2-core machine and worker starts, and still fails a serial run."""
    fn = load_reward_function(f"{peer_file}:{name}", timeout_s=timeout_s, num_threads=8)
    samples = [Sample(prompt="p", response=str(i)) for i in range(64)]
    try:
        fn.score(samples[:8])  # workers started: a start is not what is measured
        begin = time.monotonic()
        verdicts = fn.score(samples)
        blocking_s = time.monotonic() - begin

        async def stream():
            return await fn.ascore(samples)

        begin = time.monotonic()
        streamed = asyncio.run(stream())
        streaming_s = time.monotonic() - begin
    finally:
        fn.close()
    assert [v.reward for v in verdicts] == [1.0] * 64 == [v.reward for v in streamed]
    assert blocking_s < 1.6 and streaming_s < 1.6, (blocking_s, streaming_s)


@pytest.mark.parametrize("timeout_s", [1e10, math.inf, 0.0])
def test_an_unbounded_timeout_is_refused(peer_file, timeout_s) -> None:
    with pytest.raises(ValueError, match=r"timeout_s=.*at most 604800"):
        load_reward_function(f"{peer_file}:isclose", timeout_s=timeout_s)


def test_load_reward_functions_shares_one_pool_and_checks_its_lists(peer_file) -> None:
    specs = [f"{peer_file}:slow", f"{peer_file}:isclose"]
    functions = load_reward_functions(specs, weights=[1.0, 0.5], timeout_s=30.0, num_workers=2)
    (slow, w1), (isclose, w2) = functions
    assert (w1, w2) == (1.0, 0.5) and slow._pool is isclose._pool
    slow.close()
    # The pool lives on for the other function.
    assert isclose.score([Sample(prompt="p", response="1", reference="1")])[0].reward == 1.0
    isclose.close()
    assert slow._pool.stats()["num_calls"] == 1
    with pytest.raises(ValueError, match=r"forms has 1 entries for 2 reward functions"):
        load_reward_functions(specs, forms=["sample"])
    with pytest.raises(ValueError, match=r"forms\[0\]='x'"):
        load_reward_functions(specs[:1], forms=["x"])


def test_a_row_a_worker_cannot_take_is_a_data_skip(peer_file) -> None:
    # Deeper than pickle can go under this process's recursion limit (900 with the default
    # 1000; an earlier import such as torch's compiler may have raised the limit).
    nested: dict = {}
    node = nested
    for _ in range(2 * sys.getrecursionlimit()):
        node["a"] = {}
        node = node["a"]
    fn = load_reward_function(f"{peer_file}:slow", timeout_s=30.0)
    try:
        deep, fine = fn.score(
            [
                Sample(prompt="p", response="r", metadata={"x": nested}),
                Sample(prompt="p", response="r"),
            ]
        )
    finally:
        fn.close()
    assert deep.status == "error" and deep.skip_cause is not None
    assert "cannot be sent to a worker process" in deep.skip_cause
    assert fine.status == "ok"
    stats = ScoreStats.from_verdicts([deep, fine])
    assert (stats.num_errors, stats.num_data_skips, stats.num_ok) == (0, 1, 1)
    assert "RecursionError" in stats.first_data_skip


class _Custom(BaseException):
    pass


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), GeneratorExit(), SystemExit(2), _Custom("custom")]
)
def test_in_process_a_base_exception_is_that_sample_s_error_not_the_run_s(error) -> None:
    """The issue: with function_timeout_s=0 (in process) these ended the run."""

    def raises(prompt, response, reference, row):
        if response == "bad":
            raise error
        return 1.0

    fn = RewardFunction(raises)
    bad, fine = fn.score([Sample(prompt="p", response="bad"), Sample(prompt="p", response="ok")])
    assert (bad.status, fine.status, fine.reward) == ("error", "ok", 1.0)
    assert f"raised {type(error).__name__}" in bad.error

    async def stream():
        return await fn.ascore([Sample(prompt="p", response="bad")])

    assert asyncio.run(stream())[0].status == "error"
