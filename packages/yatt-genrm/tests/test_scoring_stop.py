"""Issue 49: a stop signal ends a blocking score() that cannot end (a judge or a reward function
that never answers) at its next poll, with the pending work aborted and no process left.

Each case: the scorer waits on something that never returns; the stop flag is set 0.5 s after
the call (after the reward call started, for a worker: its start-up is not what a stop cuts);
score(should_stop=flag.is_set) must raise ScoringStopped within 2 s of the flag, and the judge
request / worker process it waited on must be gone."""

NUM_GPUS = 0

import asyncio
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from yatt.genrm import (
    CombinedRM,
    ExactMatch,
    GenRM,
    JudgeTemplate,
    OpenAIJudge,
    OpenAIJudgeConfig,
    Sample,
    ScoringStopped,
    YesNoParser,
    load_reward_function,
    load_reward_functions,
    score_as_completed,
)
from yatt.genrm.testing import FakeJudgeEngine

STOP_AFTER_S = 0.5
# The stop must land within the poll interval plus the abort; 2 s leaves room for a loaded CI
# machine (worker kill and reaping included), yet a score() that waited for its call (an hour)
# or its timeout (60 s) fails it.
MAX_STOP_S = 2.0

REWARDS = textwrap.dedent(
    """
    import os, subprocess, time

    def hangs(prompt, response, reference, row):
        # A program the call starts, then a wait that never ends (as a sandbox that hangs).
        child = subprocess.Popen(["sleep", "300"])
        with open(row["pid_file"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(3600)

    def quick(prompt, response, reference, row):
        return float(response == reference)
    """
)


@pytest.fixture
def rewards(tmp_path: Path) -> Path:
    path = tmp_path / "stop_rewards.py"
    path.write_text(REWARDS)
    return path


def _stop_after(seconds: float) -> threading.Event:
    flag = threading.Event()
    timer = threading.Timer(seconds, flag.set)
    timer.daemon = True
    timer.start()
    return flag


class _StopOnceStarted:
    """A stop flag set STOP_AFTER_S after the reward call started (its pid file written): a
    worker's start-up on a loaded machine is not part of what the stop must cut short."""

    def __init__(self, pid_file: Path) -> None:
        self.flag = threading.Event()
        self.set_at = float("inf")

        def watch() -> None:
            deadline = time.monotonic() + 60.0
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(STOP_AFTER_S)
            self.set_at = time.monotonic()
            self.flag.set()

        threading.Thread(target=watch, daemon=True).start()

    def seconds_to_stop(self) -> float:
        """From the flag's setting to now (call right after score() returned)."""
        return time.monotonic() - self.set_at


def _is_alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _is_alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _read_pids(pid_file: Path, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid_file.exists() and len(pid_file.read_text().split()) == 2:
            return [int(pid) for pid in pid_file.read_text().split()]
        time.sleep(0.02)
    raise AssertionError("the reward call never started")


def _stopped_within(score, should_stop) -> float:
    begin = time.monotonic()
    with pytest.raises(ScoringStopped, match="a stop was requested while scoring"):
        score(should_stop=should_stop)
    return time.monotonic() - begin


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")
def test_a_reward_function_that_never_returns_is_stopped_and_its_processes_killed(
    rewards, tmp_path
) -> None:
    pid_file = tmp_path / "pids"
    fn = load_reward_function(f"{rewards}:hangs", timeout_s=60.0)
    try:
        sample = Sample(prompt="p", response="r", metadata={"pid_file": str(pid_file)})
        stop = _StopOnceStarted(pid_file)
        elapsed = _stopped_within(lambda **kw: fn.score([sample], **kw), stop.flag.is_set)
        assert elapsed >= STOP_AFTER_S and 0 <= stop.seconds_to_stop() < MAX_STOP_S
        worker, child = _read_pids(pid_file)
        # The worker and the program it started: killed, not orphaned.
        assert _wait_gone([worker, child]) == []
    finally:
        fn.close()


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")
def test_a_shared_pool_is_usable_after_a_stop(rewards, tmp_path) -> None:
    """A stop kills the shared pool's calls; the same functions score again afterwards, and
    the pool's counts carry over the replaced pool's."""
    pid_file = tmp_path / "pids"
    specs = [f"{rewards}:hangs", f"{rewards}:quick"]
    (hangs, _), (quick, _) = load_reward_functions(specs, timeout_s=60.0, num_workers=2)
    try:
        sample = Sample(prompt="p", response="r", metadata={"pid_file": str(pid_file)})
        stop = _StopOnceStarted(pid_file)
        _stopped_within(lambda **kw: hangs.score([sample], **kw), stop.flag.is_set)
        assert 0 <= stop.seconds_to_stop() < MAX_STOP_S
        assert _wait_gone(_read_pids(pid_file)) == []
        verdicts = quick.score(
            [Sample(prompt="p", response=r, reference="4") for r in "45"],
            should_stop=lambda: False,
        )
        assert [(v.status, v.reward) for v in verdicts] == [("ok", 1.0), ("ok", 0.0)]
        assert quick.pool_stats()["num_ok"] == 2  # the replaced pool's counts included
    finally:
        hangs.close()
        quick.close()


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")
def test_combined_rules_and_judge_stop_together(rewards, tmp_path) -> None:
    """CombinedRM: a hung reward function beside a judge; the stop kills the function's worker
    and closes the judge's stream."""
    pid_file = tmp_path / "pids"
    fn = load_reward_function(f"{rewards}:hangs", timeout_s=60.0)
    engine = FakeJudgeEngine()
    judge = GenRM(engine, template=JudgeTemplate(user="{prompt} {response}"), verdict_from="text")
    combined = CombinedRM(judge, [(fn, 1.0)])
    try:
        sample = Sample(prompt="p", response="r", metadata={"pid_file": str(pid_file)})
        stop = _StopOnceStarted(pid_file)
        _stopped_within(lambda **kw: combined.score([sample], **kw), stop.flag.is_set)
        assert 0 <= stop.seconds_to_stop() < MAX_STOP_S
        assert _wait_gone(_read_pids(pid_file)) == []
        assert engine.num_active_streams == 0
    finally:
        combined.close()
        fn.close()
        judge.close()


def test_a_local_judge_that_never_answers_is_stopped_and_its_stream_closed() -> None:
    engine = FakeJudgeEngine(batch_latency_s=3600.0)  # the judge's batch never finishes
    judge = GenRM(engine, template=JudgeTemplate(user="{prompt} {response}"), verdict_from="text")
    try:
        samples = [Sample(prompt="1+1", response=str(i)) for i in range(3)]
        flag = _stop_after(STOP_AFTER_S)
        elapsed = _stopped_within(lambda **kw: judge.score(samples, **kw), flag.is_set)
        assert STOP_AFTER_S <= elapsed < MAX_STOP_S
        assert len(engine.calls) == 1
        assert engine.num_active_streams == 0  # the engine stream was closed: requests dropped
    finally:
        judge.close()


def test_without_a_stop_the_verdicts_are_those_of_the_plain_call() -> None:
    def judge_fn(prompt_text: str, vote: int) -> str:
        return "Yes" if "1+1 2" in prompt_text else "No"

    judge = GenRM(
        FakeJudgeEngine(judge=judge_fn),
        template=JudgeTemplate(user="{prompt} {response}"),
        verdict_from="text",
    )
    combined = CombinedRM(judge, [(ExactMatch(), 0.5)])
    try:
        samples = [Sample(prompt="1+1", response=str(i), reference="2") for i in range(4)]
        plain = combined.score(samples)
        polled = combined.score(samples, should_stop=lambda: False)
        # yes (+1) and the exact match (0.5) for "2", no (-1) for the others
        assert [v.reward for v in plain] == [-1.0, -1.0, 1.5, -1.0]
        assert [(v.reward, v.status, v.components) for v in polled] == [
            (v.reward, v.status, v.components) for v in plain
        ]
        assert combined.metrics["num_samples"] == 8
    finally:
        judge.close()


def test_a_stop_already_requested_sends_nothing() -> None:
    engine = FakeJudgeEngine()
    judge = GenRM(engine, template=JudgeTemplate(user="{prompt} {response}"), verdict_from="text")
    try:
        with pytest.raises(ScoringStopped):
            judge.score([Sample(prompt="p", response="r")], should_stop=lambda: True)
        assert engine.calls == []
    finally:
        judge.close()


def test_should_stop_must_be_a_callable() -> None:
    judge = GenRM(FakeJudgeEngine(), template=JudgeTemplate(user="{prompt} {response}"))
    try:
        with pytest.raises(ValueError, match=r"should_stop=False: pass a callable"):
            judge.score([Sample(prompt="p", response="r")], should_stop=False)
    finally:
        judge.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SilentServer:
    """/v1/chat/completions on 127.0.0.1 that takes each request and never answers."""

    def __init__(self) -> None:
        self.num_requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = _free_port()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        async def chat(request: web.Request) -> web.Response:
            self.num_requests += 1
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_an_endpoint_that_never_answers_is_stopped_and_its_requests_cancelled() -> None:
    server = _SilentServer()
    judge = OpenAIJudge(
        OpenAIJudgeConfig(
            base_url=f"http://127.0.0.1:{server.port}/v1", model="judge", timeout_s=600.0
        ),
        template=JudgeTemplate(user="{prompt} {response}"),
        parser=YesNoParser(),
    )
    try:
        samples = [Sample(prompt="p", response=str(i)) for i in range(3)]
        flag = _stop_after(STOP_AFTER_S)
        elapsed = _stopped_within(lambda **kw: judge.score(samples, **kw), flag.is_set)
        assert STOP_AFTER_S <= elapsed < MAX_STOP_S
        assert server.num_requests == 3
        assert judge._num_inflight == 0  # every request's wait ended (cancelled)
    finally:
        server.stop()


def test_scoring_from_inside_a_running_loop_can_be_stopped() -> None:
    """score() called on a thread that runs an event loop (a blocking call there)."""
    engine = FakeJudgeEngine(batch_latency_s=3600.0)
    judge = GenRM(engine, template=JudgeTemplate(user="{prompt} {response}"), verdict_from="text")

    async def caller() -> float:
        flag = _stop_after(STOP_AFTER_S)
        return _stopped_within(
            lambda **kw: judge.score([Sample(prompt="p", response="r")], **kw), flag.is_set
        )

    try:
        assert asyncio.run(caller()) < MAX_STOP_S
        assert engine.num_active_streams == 0
    finally:
        judge.close()


def test_scoring_as_completed_stops_the_rollout_stream_and_the_judge() -> None:
    """The overlapped round (score_as_completed): a rollout whose tail never ends and a judge
    that never answers; the stop closes the rollout stream and the judge's."""
    engine = FakeJudgeEngine(batch_latency_s=3600.0)
    judge = GenRM(engine, template=JudgeTemplate(user="{prompt} {response}"), verdict_from="text")
    rollout_closed: list[bool] = []

    async def rollout():  # two responses, then a tail that never ends
        try:
            for text in ("a", "b"):
                yield text
            await asyncio.sleep(3600)
        finally:
            rollout_closed.append(True)

    async def run() -> None:
        flag = _stop_after(STOP_AFTER_S)
        await score_as_completed(
            rollout(),
            judge,
            lambda text: Sample(prompt="p", response=text),
            should_stop=flag.is_set,
        )

    try:
        begin = time.monotonic()
        with pytest.raises(ScoringStopped, match="while scoring 2 samples"):
            asyncio.run(run())
        assert time.monotonic() - begin < MAX_STOP_S
        assert rollout_closed == [True]
        assert engine.num_active_streams == 0
    finally:
        judge.close()
