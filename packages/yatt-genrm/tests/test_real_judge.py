NUM_GPUS = 0

import asyncio
import os
import subprocess
import sys
import time

import pytest

from yatt.genrm import (
    BatchingConfig,
    GenRM,
    GenRMClient,
    Sample,
    YesNoParser,
    verification_template,
)
from yatt.rollout import BuiltinEngine, EngineConfig, SamplingParams
from yatt.testing import free_port, make_tiny_causal_lm

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge")
    make_tiny_causal_lm(path, arch="qwen2", max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def engine(judge_dir):
    engine = BuiltinEngine(judge_dir, config=EngineConfig(max_batch_size=8, max_seq_len=1024))
    yield engine
    engine.close()


def _samples(n: int) -> list[Sample]:
    return [
        Sample(prompt=f"What is {i}+{i}?", response=f"It is {2 * i}.", reference=str(2 * i))
        for i in range(n)
    ]


def _genrm(engine, **kwargs) -> GenRM:
    args = {
        "template": verification_template(max_response_tokens=64),
        "parser": YesNoParser(),
        "sampling": SamplingParams(temperature=0.0, max_new_tokens=6),
        "default_reward": -0.25,
        # One engine call in flight: the built-in engine runs one generation at a time anyway,
        # and overlapping stream() calls hit a race in yatt.rollout's stream_from_thread (a
        # finished stream whose thread is still alive calls abort(), which can abort the next
        # call's generation); reported to the lead.
        "batching": BatchingConfig(
            max_batch_size=4, batch_window_millis=5.0, max_inflight_batches=1
        ),
        **kwargs,
    }
    return GenRM(engine, **args)


def _is_well_formed(v) -> bool:
    """A random judge rarely says Yes/No and often runs to max_new_tokens: a finished vote is
    read ("ok" or "unparsable"); one cut at its budget is an error saying so, never read."""
    if len(v.votes) != 1:
        return False
    if v.votes[0].finish_reason == "stop":
        return v.status in ("ok", "unparsable")
    return v.status == "error" and "did not finish" in v.error


def test_blocking_and_streaming_agree_on_a_real_judge(engine) -> None:
    # One sample per engine call in both paths: a random judge's logits are nearly flat, so a
    # different batch shape alone can flip a greedy token; same shapes must give same text.
    # One call in flight: see the note on max_inflight_batches in _genrm().
    genrm = _genrm(engine, batching=BatchingConfig(max_batch_size=1, max_inflight_batches=1))
    samples = _samples(6)
    blocking = genrm.score(samples)
    assert [v.sample_id for v in blocking] == [s.id for s in samples]
    for v in blocking:
        # A random judge rarely says Yes/No; either way the verdict is well formed.
        assert _is_well_formed(v)
        assert v.votes[0].finish_reason in ("stop", "length")
        assert v.reward == (v.votes[0].reward if v.status == "ok" else -0.25)

    async def stream() -> dict[str, str]:
        async def producer() -> None:
            for s in samples:
                await genrm.submit(s)
            await genrm.finish()

        task = asyncio.create_task(producer())
        got = {v.sample_id: v.text async for v in genrm.results()}
        await task
        await genrm.aclose()
        return got

    # Greedy: the streaming path (engine.stream) reads the same verdicts as engine.generate.
    assert asyncio.run(stream()) == {v.sample_id: v.text for v in blocking}


def test_streamed_batches_join_the_judges_running_decode(judge_dir) -> None:
    # Batches of 2 in flight together: the built-in engine admits later batches into its running
    # loop (free slots) instead of running them one after another; every sample still gets one
    # verdict of its own.
    engine = BuiltinEngine(judge_dir, config=EngineConfig(max_batch_size=8, max_seq_len=1024))
    genrm = _genrm(
        engine,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
        batching=BatchingConfig(max_batch_size=2, batch_window_millis=0.0, max_inflight_batches=4),
    )
    samples = _samples(8)

    async def stream() -> list:
        verdicts = await genrm.ascore(samples)
        await genrm.aclose()
        return verdicts

    try:
        verdicts = asyncio.run(stream())
    finally:
        engine.close()
    assert [v.sample_id for v in verdicts] == [s.id for s in samples]
    assert all(_is_well_formed(v) for v in verdicts)
    assert all(len(v.votes[0].text) > 0 for v in verdicts)
    assert genrm.metrics["num_batches"] == 4 and engine.num_joined_calls >= 1


def test_votes_on_a_real_judge_sample_distinct_streams(engine) -> None:
    genrm = _genrm(
        engine, votes=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    )
    (verdict,) = genrm.score(_samples(1))
    assert len(verdict.votes) == 4
    assert len({v.text for v in verdict.votes}) > 1  # different random streams per vote
    assert genrm.metrics["num_votes"] == 4


def test_serve_cli_on_loopback(judge_dir) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "yatt.genrm.serve", "--model", str(judge_dir),
        "--port", str(port), "--max-new-tokens", "4", "--max-seq-len", "1024",
        "--max-response-tokens", "64", "--max-batch", "8", "--engine-batch", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = GenRMClient(f"http://127.0.0.1:{port}", timeout_s=30)
        deadline = time.monotonic() + 90
        while True:
            try:
                assert client.health()["status"] == "ok"
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stdout.read().decode()[-2000:]) from None
                time.sleep(0.5)
        verdicts = client.score(_samples(3))
        assert [_is_well_formed(v) for v in verdicts] == [True] * 3
        too_many = client.score(_samples(9))  # over --max-batch 8 in one request
        assert {v.status for v in too_many} == {"error"} and "413" in too_many[0].error
    finally:
        proc.terminate()
        proc.wait(timeout=30)
