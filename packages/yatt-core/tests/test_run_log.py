NUM_GPUS = 0

import json

import pytest

from yatt.core import RunLog


def test_log_writes_one_line_per_step_and_tensorboard(tmp_path):
    log = RunLog(tmp_path)
    for step in range(3):
        log.log(step, {"reward/mean": step / 2, "loss": float(step)})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[2]["reward/mean"] == 1.0
    assert any((tmp_path / "tensorboard").iterdir()), "TensorBoard events were written"


def test_resume_drops_steps_from_the_resume_point(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(5):
        log.log(step, {"x": step})
    log.close()
    resumed = RunLog(tmp_path, should_use_tensorboard=False, resume_step=3)
    resumed.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in resumed.read()] == [(0, 0), (1, 1), (2, 2), (3, 30)]


def test_fresh_run_starts_a_new_file_and_non_writers_write_nothing(tmp_path):
    RunLog(tmp_path, should_use_tensorboard=False).log(0, {"x": 1})
    RunLog(tmp_path, should_use_tensorboard=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    other = tmp_path / "other"
    RunLog(other, is_writer=False).log(0, {"x": 1})
    assert not other.exists()


def test_plot_writes_a_png(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(4):
        log.log(step, {"reward/mean": step, "length": 10 - step})
    path = log.plot(["reward/mean", "length"])
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_tolerates_a_torn_last_line(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(3):
        log.log(step, {"loss": float(step)})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-write
    resumed = RunLog(tmp_path, should_use_tensorboard=False, resume_step=2)
    assert [r["step"] for r in resumed.read()] == [0, 1]
    resumed.log(2, {"loss": 2.0})
    assert [r["step"] for r in resumed.read()] == [0, 1, 2]


def test_a_damaged_line_before_the_end_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 of 3 is not JSON"):
        RunLog(tmp_path, should_use_tensorboard=False, resume_step=1)


def _wandb_records(path):
    """The protobuf records of an offline run's .wandb file. The file is wandb's framing of
    LevelDB's log format (a 7-byte ':W&B' header, then 32 KiB blocks of records, each with a
    7-byte header: crc32, length, kind 1=full 2=first 3=middle 4=last). Read here because wandb
    0.31 ships no Python reader for it, and the records are what a sync would upload."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def _wandb_run(run_file, timeout_s: float = 60.0):
    """(run id, project, config, history rows) of one offline run file. wandb's service may
    still be writing it when finish() returns: read once its exit record is there."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{run_file} got no exit record in {timeout_s} s"
        time.sleep(0.2)
    run_id = project = None
    config, history = {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, project = record.run.run_id, record.run.project
            config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            # wandb stores a key with "/" as its parts (nested_key), others as key
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
    return run_id, project, config, history


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """The real wandb package in offline mode: nothing leaves the machine."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "out"


def test_wandb_gets_every_step_and_a_resume_continues_its_run(offline_wandb):
    out = offline_wandb
    log = RunLog(out, should_use_tensorboard=False, wandb_project="p", wandb_config={"lr": 1})
    log.log(0, {"reward/mean": 0.5})
    log.log(1, {"reward/mean": 0.7})
    log.close()
    (first,) = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    run_id, project, config, history = _wandb_run(first)
    assert run_id == (out / "wandb_run_id").read_text().strip()
    assert (project, config["lr"]) == ("p", 1)
    assert history == [{"step": 0, "reward/mean": 0.5}, {"step": 1, "reward/mean": 0.7}]

    resumed = RunLog(out, should_use_tensorboard=False, resume_step=1, wandb_project="p")
    resumed.log(1, {"reward/mean": 0.9})
    resumed.close()
    second = [p for p in out.glob("wandb/offline-run-*/run-*.wandb") if p != first]
    assert len(second) == 1
    resumed_id, _, _, resumed_history = _wandb_run(second[0])
    assert resumed_id == run_id, "a resume continues the same W&B run"
    assert resumed_history == [{"step": 1, "reward/mean": 0.9}]


def test_two_fresh_runs_get_different_wandb_ids(offline_wandb):
    ids = []
    for name in ("a", "b"):
        RunLog(offline_wandb / name, should_use_tensorboard=False, wandb_project="p").close()
        ids.append((offline_wandb / name / "wandb_run_id").read_text().strip())
    assert ids[0] != ids[1] and all(i.isalnum() and i.islower() for i in ids)


def test_a_wandb_project_without_wandb_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install wandb"):
        RunLog(tmp_path, wandb_project="p")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_log_samples_writes_jsonl_and_tensorboard_text_and_resumes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from yatt.core.runtime._run_log import MAX_SAMPLE_CHARS

    log = RunLog(tmp_path)
    long_text = "x" * (MAX_SAMPLE_CHARS + 10)
    for step in range(3):
        log.log_samples(step, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    log.log_samples(3, [{"prompt": "p|q", "completion": long_text, "reward": -1.0}])
    log.log_samples(4, [])  # nothing sampled: nothing written
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0] == {"step": 0, "prompt": "1+1=", "completion": "2", "reward": 1.0}
    assert rows[3]["completion"].endswith("...[10 chars cut]")
    assert len(rows[3]["completion"]) < MAX_SAMPLE_CHARS + 30
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = [tag for tag in events.Tags()["tensors"] if tag.startswith("samples")]
    assert [e.step for e in events.Tensors(text)] == [0, 1, 2, 3]
    table = events.Tensors(text)[3].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | reward |" in table and "p\\|q" in table

    resumed = RunLog(tmp_path, should_use_tensorboard=False, resume_step=2)
    assert [r["step"] for r in resumed.read_samples()] == [0, 1]
    RunLog(tmp_path, should_use_tensorboard=False)  # a fresh run: no stale samples
    assert not (tmp_path / "samples.jsonl").exists()


def _records():
    """Ten steps: a noisy reward, an eval every 5 steps, a CUDA counter that is 0 on CPU."""
    records = []
    for step in range(10):
        record = {"step": step, "reward/accuracy": float(step % 2), "memory/cuda_gb": 0.0}
        if step % 5 == 0:
            record |= {"eval/accuracy": 0.1 * step, "eval/num_samples": 8.0}
        records.append(record)
    return records


def test_the_plot_draws_eval_curves_beside_training_and_leaves_out_flat_counters():
    from yatt.core.runtime._run_log import plan_plot

    panels = {p.key: p for p in plan_plot(_records(), None)}
    # The CUDA counter never changes; eval/num_samples neither: both left out.
    assert list(panels) == ["reward/accuracy"]
    train, evaluation = panels["reward/accuracy"].lines
    assert train.steps == list(range(10)) and not train.is_eval
    assert (evaluation.key, evaluation.steps, evaluation.values) == (
        "eval/accuracy",
        [0, 5],
        [0.0, 0.5],
    )
    assert evaluation.is_eval and evaluation.smoothed is None  # sparse points: drawn as they are
    # Asked by name, an eval key with no training key has its own panel.
    (alone,) = plan_plot(_records(), ["eval/accuracy"])
    assert alone.lines[0].values == [0.0, 0.5]


def test_noisy_lines_are_smoothed_as_tensorboard_does():
    from yatt.core.runtime._run_log import SMOOTHING, plan_plot

    (panel,) = plan_plot(_records(), ["reward/accuracy"])
    (line,) = [ln for ln in panel.lines if not ln.is_eval]
    w = SMOOTHING
    # The debiased EMA in closed form: s_t = sum_k (1 - w) w^(t - k) x_k / (1 - w^t).
    xs = [float(t % 2) for t in range(10)]
    want = [
        sum((1 - w) * w ** (t - k) * xs[k - 1] for k in range(1, t + 1)) / (1 - w**t)
        for t in range(1, 11)
    ]
    assert line.smoothed == pytest.approx(want, rel=1e-12)
    assert line.smoothed[0] == 0.0 and 0.3 < line.smoothed[-1] < 0.7  # between the extremes
    few = [{"step": s, "loss": float(s % 2)} for s in range(4)]
    assert plan_plot(few, ["loss"])[0].lines[0].smoothed is None  # too few points to smooth


def test_plot_of_every_varying_key_writes_a_png(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for record in _records():
        log.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    path = log.plot()
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_samples_reach_wandb_as_a_table(offline_wandb):
    out = offline_wandb
    log = RunLog(out, should_use_tensorboard=False, wandb_project="p")
    log.log(0, {"reward/mean": 0.5})
    log.log_samples(0, [{"prompt": "1+1=", "completion": "2", "reward": 1.0, "meta": {"a": 1}}])
    log.close()
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    *_, history = _wandb_run(run_file)
    # wandb keeps the step's metrics and its table in one history row, the table's fields
    # flattened under "samples/".
    (row,) = history
    assert (row["reward/mean"], row["samples/_type"], row["samples/nrows"]) == (
        0.5,
        "table-file",
        1,
    )
    table = json.loads(next(run_file.parent.glob("files/" + row["samples/path"])).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward", "meta"]
    assert table["data"] == [[0, "1+1=", "2", 1.0, '{"a": 1}']]
