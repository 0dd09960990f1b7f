"""AsyncRollout on CPU threads with a fake engine (issue 48): rollout runs ahead of training
under admission control, every token carries the version that sampled it, slow groups are
paced (never discarded), and a state_dict taken mid-run resumes every in-flight prompt once."""

NUM_GPUS = 0

import sys
import time
from pathlib import Path

import pytest

from yatt.core import ROW_INDEX_KEY, AdmissionControl, AsyncRollout, ShardedLoader

# The fakes are shared with the real-process worker (a script, which imports them by path).
sys.path.insert(0, str(Path(__file__).parent))
from _offpolicy_fakes import FakeEngine, write_prompts

P = 4  # prompts per step
TIMEOUT_S = 60.0


def _driver(path, engine, *, s, version=0, **kwargs):
    loader = ShardedLoader(path, batch_size=P, should_shuffle=False)
    admission = AdmissionControl(max_staleness=s, prompts_per_step=P)
    return AsyncRollout(
        loader=loader,
        generate=engine.generate,
        admission=admission,
        version=version,
        num_workers=8,
        **kwargs,
    )


def _train(driver, version, num_steps, on_step=None):
    """The trainer's loop: take P groups, 'train', push the next version."""
    taken = []
    for _ in range(num_steps):
        groups = driver.take(P, timeout_s=TIMEOUT_S)
        taken.append((version, groups))
        version += 1
        driver.set_version(version)
        if on_step is not None:
            on_step(version)
    return taken, version


@pytest.mark.parametrize("s", [0, 1, 2])
def test_a_slow_tail_is_paced_not_discarded_and_its_tokens_span_versions(tmp_path, s):
    slow = (1, 6)
    path = write_prompts(tmp_path / "p.jsonl", 16, slow_rows=slow)
    engine = FakeEngine()

    def release_tail_at(version):
        # The tail ends only after the trainer moved on three versions: without pacing, a
        # driver waiting for it (or dropping it) would show here.
        if version == 2 and s >= 1:
            # Both slow prompts are admitted by now; on a busy CPU their workers may not have
            # run yet: let them emit their first token before version 3 is pushed, so each
            # starts under an older version than the one that releases it.
            deadline = time.monotonic() + TIMEOUT_S
            while set(engine.slow_rows_started) != set(slow):
                assert time.monotonic() < deadline, "a slow prompt never started"
                time.sleep(0.01)
        if version == 3:
            engine.slow_gate.set()

    with _driver(path, engine, s=s) as driver:
        driver.start()
        if s == 0:
            # On-policy: the slow groups belong to step 0 and step 1, so the trainer waits.
            engine.slow_gate.set()
        # Groups are taken as they finish, so the slow ones may come after prompts of the next
        # epoch: train until every prompt of the first epoch (numbers 0..15) was taken.
        # (A deadline in seconds, not in steps: on a busy CPU the released tail threads may
        # be scheduled only after the trainer took many fast groups.)
        taken, version = _train(driver, 0, 4, on_step=release_tail_at)
        deadline = time.monotonic() + TIMEOUT_S
        while not set(range(16)) <= {g.number for _, groups in taken for g in groups}:
            assert time.monotonic() < deadline, "a slow group never came back"
            more, version = _train(driver, version, 1)
            taken += more
    numbers = [g.number for _, groups in taken for g in groups]
    assert len(numbers) == len(set(numbers))  # none twice
    for _, groups in taken:
        for group in groups:
            assert group.result["row_index"] == group.row_index == group.number % 16
    for trained_at, groups in taken:
        for group in groups:
            versions = group.result["versions"]
            # Stamped with the weights that sampled each token: at least the version it was
            # admitted under (a queued worker may start after a push), never decreasing,
            # never newer than the trainer that takes it.
            assert versions[0] >= group.version
            assert versions == sorted(versions) and versions[-1] <= trained_at
            # Admission: prompt number n starts under w with n // P - w <= s (never too old
            # at its start), and for s = 0 exactly on-policy.
            assert 0 <= group.number // P - group.version <= s
            if s == 0:
                assert group.version == group.number // P == trained_at
                assert set(versions) == {trained_at}
    if s >= 1:
        by_number = {g.number: (v, g) for v, groups in taken for g in groups}
        for number in slow:  # in the first epoch a prompt's number is its row
            trained_at, group = by_number[number]
            # Started early, finished once the trainer was at version 3: one response
            # spanning versions, trained late (older than s) rather than dropped.
            versions = group.result["versions"]
            assert versions[0] < 3 <= versions[-1]
            assert trained_at >= 3


def test_fast_tails_run_ahead_up_to_the_bound_and_no_further(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 40)
    engine = FakeEngine()
    with _driver(path, engine, s=2) as driver:
        driver.start()
        # Before any training, generation fills exactly s + 1 steps' prompts and stops.
        groups = driver.take(3 * P, timeout_s=TIMEOUT_S)
        assert sorted(g.number for g in groups) == list(range(3 * P))
        assert {g.version for g in groups} == {0}
        assert driver.num_in_flight == 0
        with pytest.raises(TimeoutError):
            driver.take(1, timeout_s=0.3)  # nothing more may start under version 0
        driver.set_version(1)
        more = driver.take(P, timeout_s=TIMEOUT_S)
        assert sorted(g.number for g in more) == list(range(3 * P, 4 * P))
        assert {g.version for g in more} == {1}


def test_a_failing_generate_is_counted_and_its_slot_given_back(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 8)
    engine = FakeEngine()

    def generate(row, version):
        if row[ROW_INDEX_KEY] == 2:
            raise RuntimeError("the user's reward function crashed")
        return engine.generate(row, version)

    loader = ShardedLoader(path, batch_size=P, should_shuffle=False)
    admission = AdmissionControl(max_staleness=0, prompts_per_step=P)
    with AsyncRollout(loader=loader, generate=generate, admission=admission) as driver:
        driver.start()
        groups = driver.take(P, timeout_s=TIMEOUT_S)  # row 4 takes row 2's slot
        assert driver.num_failed == 1
        assert sorted(g.result["row_index"] for g in groups) == [0, 1, 3, 4]


def _finished_in(state):
    return [p for p in state["in_flight"]["prompts"] if p["finish_order"] >= 0]


def test_in_flight_prompts_resume_exactly_once_from_a_state_dict(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 16, slow_rows=(1, 6))
    engine = FakeEngine(name="before the kill")
    driver = _driver(path, engine, s=1)
    driver.start()
    taken, version = _train(driver, 0, 2)
    # At version 2, 16 prompts started, 8 taken: the 2 slow ones generate, 6 fast ones finish.
    deadline = time.monotonic() + TIMEOUT_S
    while len(_finished_in(state := driver.state_dict())) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    unfinished = {p["number"] for p in state["in_flight"]["prompts"] if p["finish_order"] < 0}
    finished = {p["number"] for p in _finished_in(state)}
    assert unfinished == {1, 6} and len(finished) == 6
    engine.slow_gate.set()
    driver.close()

    resumed_engine = FakeEngine(name="after the resume")
    resumed_engine.slow_gate.set()
    resumed = _driver(path, resumed_engine, s=1)
    resumed.load_state_dict(state)
    resumed.start()
    assert resumed.num_requeued == 2
    more = []
    deadline = time.monotonic() + 20.0  # a lost prompt fails here (and num_requeued above)
    while not set(range(16)) <= {g.number for _, groups in taken + more for g in groups}:
        assert time.monotonic() < deadline, "an in-flight prompt was lost on resume"
        step, version = _train(resumed, version, 1)
        more += step
    resumed.close()
    numbers = [g.number for _, groups in taken + more for g in groups]
    assert len(numbers) == len(set(numbers))  # none twice
    for _, groups in taken + more:
        for group in groups:
            assert group.result["row_index"] == group.number % 16
    # A finished group is trained from the checkpoint, not generated again; the slow ones are.
    # By prompt number: the resumed driver also starts the next epoch, whose rows repeat the
    # first epoch's row indices (a check by row index failed whenever it got that far).
    generated_by = {g.number: g.result["engine"] for _, groups in taken + more for g in groups}
    assert {generated_by[n] for n in finished} == {"before the kill"}
    assert {generated_by[n] for n in (1, 6)} == {"after the resume"}


def test_filtered_groups_give_their_slots_back_and_metrics_report_the_wait(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 40)
    engine = FakeEngine()
    with _driver(path, engine, s=0) as driver:
        driver.start()
        groups = driver.take(P, timeout_s=TIMEOUT_S)
        with pytest.raises(TimeoutError):
            driver.take(1, timeout_s=0.2)  # s = 0: nothing more under version 0
        # The dynamic sampler dropped 2 of the 4 (no reward variance): their slots come back,
        # so 2 more prompts start under the same weights.
        driver.release(2)
        refill = driver.take(2, timeout_s=TIMEOUT_S)
        assert sorted(g.number for g in groups + refill) == list(range(P + 2))
        assert {g.version for g in refill} == {0}
        metrics = driver.metrics()
        assert metrics["offpolicy/take_wait_s"] >= 0.2  # the timed-out take waited too
        assert metrics["offpolicy/num_in_flight"] == 0
        assert driver.metrics()["offpolicy/take_wait_s"] == 0.0  # reset per step


def test_without_saved_results_finished_groups_are_generated_again_once(tmp_path):
    # should_save_results=False (results that are not JSON-able): a finished-untaken prompt
    # is written as unfinished, so a resume generates it again; every prompt still once.
    # 40 rows: the resumed run's last push admits prompts 16..19, which with 16 rows would be a
    # second epoch's rows 0..3 (a saved prompt's row seen twice when they start before close).
    path = write_prompts(tmp_path / "p.jsonl", 40)
    engine = FakeEngine()
    driver = _driver(path, engine, s=1, should_save_results=False)
    driver.start()
    taken, version = _train(driver, 0, 1)
    deadline = time.monotonic() + TIMEOUT_S
    while driver.metrics()["offpolicy/num_finished_waiting"] < 2 * P:  # 8 admitted at v=1
        assert time.monotonic() < deadline
        time.sleep(0.01)
    state = driver.state_dict()
    driver.close()
    assert not _finished_in(state)
    assert all(p["result"] is None for p in state["in_flight"]["prompts"])
    in_flight = sorted(p["number"] for p in state["in_flight"]["prompts"])
    taken_numbers = {g.number for _, groups in taken for g in groups}
    assert in_flight == sorted(set(range(3 * P)) - taken_numbers)

    resumed_engine = FakeEngine()
    with _driver(path, resumed_engine, s=1, should_save_results=False) as resumed:
        resumed.load_state_dict(state)
        resumed.start()
        assert resumed.num_requeued == 2 * P
        more, _ = _train(resumed, version, 2)
        left = [p["number"] for p in resumed.state_dict()["in_flight"]["prompts"]]
    numbers = [g.number for _, groups in taken + more for g in groups]
    # taken before or after the resume, or still in flight: none skipped, none twice (the
    # next step's new prompts may finish before the re-queued ones)
    assert sorted(numbers + left) == list(range(len(numbers) + len(left)))
    assert len(numbers) == 3 * P
    # each saved prompt generated again, once (first epoch: a prompt's number is its row)
    assert all(resumed_engine.rows_seen.count(number) == 1 for number in in_flight)


def test_put_back_groups_are_taken_again_and_kept_in_the_checkpoint(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 16)
    with _driver(path, FakeEngine(), s=0) as driver:
        driver.start()
        groups = driver.take(P, timeout_s=TIMEOUT_S)
        state = driver.state_dict()
        assert not state["in_flight"]["prompts"]
        driver.put_back(groups[:2])  # a stop signal ended the step: not trained
        assert {p["number"] for p in driver.state_dict()["in_flight"]["prompts"]} == {
            g.number for g in groups[:2]
        }
        again = driver.take(2, timeout_s=TIMEOUT_S)
        assert [g.number for g in again] == [g.number for g in groups[:2]]  # finish order kept
        # P taken, none released, no new version: nothing can come (a lost slot if unfilled)
        assert driver.is_stalled
        driver.release(1)
        assert not driver.is_stalled or driver.num_in_flight  # a slot back: one more starts


def test_paused_holds_new_generations_back_and_close_aborts(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 16)
    engine = FakeEngine()
    aborted = []
    loader = ShardedLoader(path, batch_size=P, should_shuffle=False)
    driver = AsyncRollout(
        loader=loader,
        generate=engine.generate,
        admission=AdmissionControl(max_staleness=1, prompts_per_step=P),
        num_workers=8,
        abort=lambda: aborted.append(True),
    )
    with driver.paused():
        driver.start()
        deadline = time.monotonic() + TIMEOUT_S
        while driver.num_in_flight < 2 * P:  # the generator admits 2 P prompts ...
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert engine.num_calls == 0  # ... and none may generate while paused
    groups = driver.take(2 * P, timeout_s=TIMEOUT_S)
    assert len(groups) == 2 * P and engine.num_calls == 2 * P
    driver.close()
    assert aborted == [True]
