"""Nothing lost on a crash (issue 48): a real trainer process running off-policy (s = 1) is
SIGKILLed mid-epoch after a checkpoint, with slow prompts in flight; a second process resumes
from the checkpoint (ShardedLoader state + in-flight prompts). Across both, every prompt of
the epoch is trained exactly once in the committed steps: none skipped, none twice."""

NUM_GPUS = 0

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _offpolicy_fakes import write_prompts

WORKER = Path(__file__).with_name("_offpolicy_resume_worker.py")
NUM_ROWS = 24


def _run_worker(data, out, mode):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), str(data), str(out), mode], env=env)


def test_every_prompt_of_an_epoch_is_trained_once_across_a_kill_and_a_resume(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", NUM_ROWS, slow_rows=range(1, NUM_ROWS, 4))
    out = tmp_path / "run"
    out.mkdir()
    first = _run_worker(data, out, "first")
    deadline = time.monotonic() + 120
    while not (out / "killable").exists():
        assert first.poll() is None, "the first run exited before its checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)  # mid-epoch, slow prompts generating
    assert first.wait(timeout=60) == -signal.SIGKILL
    ckpt = json.loads((out / "ckpt.json").read_text())
    in_flight = ckpt["rollout"]["in_flight"]["prompts"]
    assert any(p["finish_order"] < 0 for p in in_flight), "nothing was in flight at the kill"

    resumed = _run_worker(data, out, "resume")
    assert resumed.wait(timeout=300) == 0
    assert json.loads((out / "requeued.json").read_text()) > 0
    numbers, rows = [], []
    for f in sorted(out.glob("trained_*.json")):
        trained = json.loads(f.read_text())
        numbers += trained["numbers"]
        rows += trained["rows"]
    assert len(numbers) == len(set(numbers)), "a prompt was trained twice"
    assert set(range(NUM_ROWS)) <= set(numbers), "a prompt of the epoch was skipped"
    # The epoch's prompts are its rows, each once (numbers 0..23 are the first epoch).
    epoch_rows = [r for n, r in zip(numbers, rows, strict=True) if n < NUM_ROWS]
    assert sorted(epoch_rows) == list(range(NUM_ROWS))
