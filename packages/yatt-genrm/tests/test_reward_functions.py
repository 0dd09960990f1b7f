NUM_GPUS = 0

import asyncio
import logging
import math
import re
import sys
import threading
import time

import pytest

from yatt.genrm import (
    CombinedRM,
    ExactMatch,
    GenRM,
    JudgeTemplate,
    RewardFunction,
    Sample,
    ScoreStats,
    YesNoParser,
    load_reward_function,
    score_as_completed,
)
from yatt.genrm.testing import FakeJudgeEngine

pytestmark = pytest.mark.timeout(30)

REWARDS_PY = """
import math

calls = []


def score(prompt, response, reference, row):
    calls.append((prompt, response, reference, row))
    if row.get("mode") == "raise":
        return 1 / 0
    if row.get("mode") == "none":
        return None
    if row.get("mode") == "nan":
        return math.nan
    if row.get("mode") == "str":
        return "0.5"
    if row.get("mode") == "bool":
        return response == reference
    return float(response == reference)


def length(prompt, response, reference, row):
    return len(response) / 10


def two_args(prompt, response):
    return 0.0


class Scorer:
    def __call__(self, prompt, response, reference, row):
        return 0.25


scorer = Scorer()
not_a_function = 3
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    """The same code as an importable module `yatt_test_rewards`."""
    (tmp_path / "yatt_test_rewards.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "yatt_test_rewards"
    sys.modules.pop("yatt_test_rewards", None)


def _sample(response: str, mode: str = "", reference: str | None = "4") -> Sample:
    return Sample(prompt="2+2?", response=response, reference=reference, metadata={"mode": mode})


def test_loaded_by_module_and_by_file_path(rewards_file, rewards_module) -> None:
    by_module = load_reward_function(f"{rewards_module}:score")
    by_file = load_reward_function(f"{rewards_file}:score")
    assert by_module.name == "yatt_test_rewards:score"
    assert by_file.name == "my_rewards:score"
    samples = [_sample("4"), _sample("5")]
    for fn in (by_module, by_file):
        assert [v.reward for v in fn.score(samples)] == [1.0, 0.0]
    # Called with (prompt, response, reference, row): the row is the sample's metadata.
    module = sys.modules[rewards_module]
    assert module.calls[0] == ("2+2?", "4", "4", {"mode": ""})
    # A file is run once per process, however often it is loaded.
    again = load_reward_function(f"{rewards_file}:length")
    assert again.fn.__globals__ is by_file.fn.__globals__
    # An instance with __call__ and a dotted attribute work too.
    assert load_reward_function(f"{rewards_file}:scorer").score([_sample("4")])[0].reward == 0.25
    method = load_reward_function(f"{rewards_file}:scorer.__call__", name="call")
    assert method.name == "call" and method.score([_sample("4")])[0].reward == 0.25


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon", "write 'my_module:score'"),
        ("mod:", "write 'my_module:score'"),
        ("yatt_no_such_module_xyz:score", "no module named 'yatt_no_such_module_xyz'"),
        ("{file}:nope", r"has no attribute 'nope'; it has Scorer, length, score, scorer, two_args"),
        ("{file}:not_a_function", r"is not callable \(its type is int\)"),
        ("{file}:Scorer", "is a class"),
        ("{file}:two_args", r"two_args\(prompt, response\) cannot be called as fn\(prompt"),
        ("{dir}/missing.py:score", "there is no file"),
        ("{broken}:score", "running .* failed: NameError"),
    ],
    ids=[
        "no_colon",
        "no_attr",
        "no_module",
        "missing_attr",
        "not_callable",
        "class",
        "signature",
        "no_file",
        "file_raises",
    ],
)
def test_loading_errors_say_what_to_fix(spec, match, rewards_file, tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("undefined_name\n")
    spec = spec.format(file=rewards_file, dir=tmp_path, broken=broken)
    with pytest.raises(ValueError, match=match):
        load_reward_function(spec)
    assert "yatt_reward_broken" not in " ".join(sys.modules)  # a failed file is not kept


def test_module_that_fails_its_own_import_is_not_reported_missing(tmp_path, monkeypatch) -> None:
    (tmp_path / "yatt_test_bad_import.py").write_text("import yatt_not_installed_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"importing 'yatt_test_bad_import' failed.*abc"):
        load_reward_function("yatt_test_bad_import:score")


def test_module_in_the_working_directory_gets_a_hint(tmp_path, monkeypatch) -> None:
    (tmp_path / "yatt_cwd_rewards.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"write 'yatt_cwd_rewards.py:score' \(a file path\)"):
        load_reward_function("yatt_cwd_rewards:score")
    assert load_reward_function("yatt_cwd_rewards.py:score").score([_sample("4")])[0].reward == 1


def test_direct_construction_checks_the_callable() -> None:
    async def async_score(prompt, response, reference, row):
        return 1.0

    # An async function is awaited (it was refused before the worker pool ran coroutines).
    assert RewardFunction(async_score).score([_sample("x")])[0].reward == 1.0
    with pytest.raises(ValueError, match=r"cannot be called as fn\(prompt, response, reference"):
        RewardFunction(lambda prompt, response, reference, row, *, extra: 1.0)
    with pytest.raises(ValueError, match="other than 'judge'"):
        RewardFunction(lambda *args: 1.0, name="judge")
    fn = RewardFunction(lambda prompt, response, reference=None, row=None: 1.0)
    assert fn.score([_sample("x")])[0].reward == 1.0


def test_failures_are_error_verdicts_with_their_cause(rewards_file, caplog) -> None:
    fn = load_reward_function(f"{rewards_file}:score", default_reward=-1.0)
    modes = ["", "raise", "nan", "str", "bool", "none"]
    with caplog.at_level(logging.WARNING, logger="yatt.genrm"):
        verdicts = fn.score([_sample("4", mode) for mode in modes])
    assert [v.status for v in verdicts] == ["ok", "error", "error", "error", "ok", "unparsable"]
    assert [v.reward for v in verdicts] == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]
    raised, nan, text = verdicts[1].error, verdicts[2].error, verdicts[3].error
    # The cause names the function, the exception and the line that raised it.
    assert re.fullmatch(
        r"my_rewards:score raised ZeroDivisionError: division by zero "
        r"\(at my_rewards\.py:\d+ in score\)",
        raised,
    )
    assert nan == "my_rewards:score returned nan; return a finite number, or None"
    assert "returned '0.5' (a str)" in text
    assert verdicts[5].error == "my_rewards:score returned None (cannot score this sample)"
    assert verdicts[0].components == {"my_rewards:score": 1.0}
    assert "ZeroDivisionError" in caplog.text
    stats = ScoreStats.from_verdicts(verdicts)
    assert (stats.num_ok, stats.num_errors, stats.num_unparsable) == (2, 3, 1)
    assert stats.first_error == f"sample {verdicts[1].sample_id}: {raised}"
    assert stats.first_unparsable == f"sample {verdicts[5].sample_id}: {verdicts[5].error}"
    assert (fn.metrics["num_errors"], fn.metrics["num_unparsable"]) == (3, 1)


def test_weighted_functions_combine_without_a_judge(rewards_file) -> None:
    score = load_reward_function(f"{rewards_file}:score")
    length = load_reward_function(f"{rewards_file}:length")
    combined = CombinedRM(None, [(score, 1.0), (length, 0.5)], default_reward=-2.0)
    ok, failed, unscorable_one = combined.score(
        [_sample("4"), _sample("4444", "raise"), _sample("44", "none")]
    )
    assert (ok.status, ok.reward) == ("ok", 1.0 + 0.5 * 0.1)
    assert ok.components == {"my_rewards:score": 1.0, "my_rewards:length": 0.1}
    # A failed function adds 0 and makes the verdict an error naming it; the others still count.
    assert (failed.status, failed.reward) == ("error", pytest.approx(0.5 * 0.4))
    assert failed.error.startswith("my_rewards:score raised ZeroDivisionError")
    # One function cannot score: it adds 0, as a rule's None does next to a judge.
    assert (unscorable_one.status, unscorable_one.reward) == ("ok", pytest.approx(0.1))
    assert combined.metrics["num_rule_errors"] == 1

    only_none = CombinedRM(None, [(score, 1.0)], default_reward=-2.0)
    (verdict,) = only_none.score([_sample("4", "none")])
    assert (verdict.status, verdict.reward) == ("unparsable", -2.0)
    assert "every rule returned None" in ScoreStats.from_verdicts([verdict]).first_unparsable


def test_functions_beside_a_judge_sum_with_weights(rewards_file) -> None:
    judge = GenRM(
        FakeJudgeEngine(judge=lambda p, k: "Yes" if "R=4" in p else "No"),
        template=JudgeTemplate(user="R={response}"),
        parser=YesNoParser(),
    )
    score = load_reward_function(f"{rewards_file}:score")
    combined = CombinedRM(judge, [(score, 2.0), (ExactMatch(), 1.0)], judge_weight=0.5)
    good, bad, raised = combined.score([_sample("4"), _sample("5"), _sample("4", "raise")])
    assert good.reward == 0.5 * 1 + 2.0 * 1 + 1.0 * 1
    assert bad.reward == 0.5 * -1 + 0 + 0
    assert good.components == {"my_rewards:score": 1.0, "exact_match": 1.0, "judge": 1.0}
    # The judge said Yes, the function raised: its share is 0 and the status says it failed.
    assert (raised.status, raised.reward) == ("error", 0.5 * 1 + 1.0 * 1)
    assert "ZeroDivisionError" in raised.error


def test_rule_only_combination_rejects_what_needs_a_judge(rewards_file) -> None:
    score = load_reward_function(f"{rewards_file}:score")
    with pytest.raises(ValueError, match="mode='gate' gates a judge"):
        CombinedRM(None, [(score, 1.0)], mode="gate")
    with pytest.raises(ValueError, match=r"not a \(verifier, weight\) pair"):
        CombinedRM(None, [score])
    with pytest.raises(ValueError, match=r"unique.*name="):
        CombinedRM(None, [(score, 1.0), (load_reward_function(f"{rewards_file}:score"), 1.0)])
    with pytest.raises(ValueError, match="has no score"):
        CombinedRM(object(), [(score, 1.0)])


async def _completions(responses: list[str]):
    for response in responses:
        yield response
        await asyncio.sleep(0)


def test_streaming_scores_off_the_event_loop(rewards_file) -> None:
    """A slow function runs on a worker thread: the loop keeps ticking while it works, and
    score_as_completed gives the same verdicts as score()."""
    loop_thread = []

    def slow(prompt, response, reference, row):
        loop_thread.append(threading.current_thread().name)
        time.sleep(0.02)
        return float(response == reference)

    responses = ["4", "5", "4", "x"] * 3
    for scorer in (RewardFunction(slow), CombinedRM(None, [(RewardFunction(slow), 1.0)])):
        loop_thread.clear()

        async def main(scorer=scorer):
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.005)

            ticker = asyncio.create_task(tick())
            scored = await score_as_completed(_completions(responses), scorer, _sample)
            ticker.cancel()
            await scorer.aclose()
            return scored, ticks

        scored, ticks = asyncio.run(main())
        assert [v.reward for v in scored.verdicts] == [float(r == "4") for r in responses]
        assert ticks >= 20  # ~12 * 20 ms of work; a blocked loop would tick about once
        assert all(name.startswith("yatt-user-code") for name in loop_thread)
        assert scored.stats.num_ok == len(responses)


def test_streaming_failures_are_verdicts_not_exceptions(rewards_file) -> None:
    fn = load_reward_function(f"{rewards_file}:score")
    samples = [_sample("4", mode) for mode in ("", "raise", "none", "str")]

    async def main():
        verdicts = await fn.ascore(samples)
        await fn.aclose()
        return verdicts

    verdicts = asyncio.run(main())
    assert [v.status for v in verdicts] == ["ok", "error", "unparsable", "error"]
    assert all(math.isfinite(v.reward) for v in verdicts)


def test_several_threads_score_in_parallel() -> None:
    active = peak = 0
    lock = threading.Lock()

    def io_bound(prompt, response, reference, row):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.03)
        with lock:
            active -= 1
        return 1.0

    fn = RewardFunction(io_bound, num_threads=4)

    async def main():
        verdicts = await fn.ascore([_sample(str(i)) for i in range(8)])
        await fn.aclose()
        return verdicts

    assert [v.reward for v in asyncio.run(main())] == [1.0] * 8
    assert peak == 4


def test_reward_function_is_a_rule_verifier(rewards_file) -> None:
    fn = load_reward_function(f"{rewards_file}:score")
    assert fn.verify(_sample("4")) == 1.0
    assert fn.verify(_sample("4", "none")) is None
    with pytest.raises(ValueError, match=r"returned '0\.5'"):
        fn.verify(_sample("4", "str"))
    assert repr(fn) == "RewardFunction('my_rewards:score')"


def test_a_reward_function_sees_the_rows_image() -> None:
    """The row travels whole: a function can score by the image (here: is it mostly red?)
    while the text-only judge beside it is sent no image."""
    Image = pytest.importorskip("PIL.Image")

    def is_red(prompt, response, reference, row):
        red, green, blue = row["image"].convert("RGB").getpixel((0, 0))
        return float(red > 128 and green < 128 and blue < 128)

    requests = []
    engine = FakeJudgeEngine(judge=lambda p, k: "Yes")
    generate = engine.generate

    def recording_generate(batch, sampling):
        requests.extend(batch)
        return generate(batch, sampling)

    engine.generate = recording_generate
    judge = GenRM(engine, template=JudgeTemplate(user="R={response}"), parser=YesNoParser())
    combined = CombinedRM(judge, [(RewardFunction(is_red, name="is_red"), 1.0)], judge_weight=0.5)
    samples = [
        Sample(prompt="q", response="r", metadata={"image": Image.new("RGB", (2, 2), color)})
        for color in ("red", "blue")
    ]
    red, blue = combined.score(samples)
    assert red.components == {"is_red": 1.0, "judge": 1.0}
    assert blue.components == {"is_red": 0.0, "judge": 1.0}
    assert [r.images for r in requests] == [None, None]
    # Streaming hands the function the same row.
    assert [v.reward for v in asyncio.run(RewardFunction(is_red).ascore(samples))] == [1.0, 0.0]
