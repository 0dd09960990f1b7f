"""One trainer process of test_offpolicy_resume.py: an off-policy loop (AsyncRollout, s = 1)
over a JSONL epoch with slow rows, checkpointing after every step; the first run is SIGKILLed
by the test after a checkpoint, the second resumes from it.

    python _offpolicy_resume_worker.py DATA OUT first   # writes OUT/killable after step 2's ckpt
    python _offpolicy_resume_worker.py DATA OUT resume  # runs until the epoch's prompts are trained

Per committed step k it writes OUT/trained_k.json (the prompt numbers and rows trained at k);
a checkpoint at step k commits trained_0..k-1, so a resume deletes any trained_j with j >= k
(the steps the kill cut short are redone, as a trainer's metric lines are).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _offpolicy_fakes import FakeEngine

from yatt.core import AdmissionControl, AsyncRollout, ShardedLoader

P, S, NUM_ROWS, KILL_AFTER_STEP = 4, 1, 24, 2


def write_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    with tmp.open() as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def trained_numbers(out: Path) -> set[int]:
    return {n for f in out.glob("trained_*.json") for n in json.loads(f.read_text())["numbers"]}


def main(data: str, out_dir: str, mode: str) -> None:
    out = Path(out_dir)
    loader = ShardedLoader(data, batch_size=P, seed=5)  # shuffled: rows out of file order
    admission = AdmissionControl(max_staleness=S, prompts_per_step=P)
    engine = FakeEngine(slow_s=1.5)
    driver = AsyncRollout(loader=loader, generate=engine.generate, admission=admission)
    step = 0
    ckpt = out / "ckpt.json"
    if mode == "resume":
        state = json.loads(ckpt.read_text())
        step = state["step"]
        for f in out.glob("trained_*.json"):
            if int(f.stem.split("_")[1]) >= step:
                f.unlink()  # not committed: the step is redone
        driver.load_state_dict(state["rollout"])
        driver.set_version(step)
    driver.start()
    if mode == "resume":
        (out / "requeued.json").write_text(json.dumps(driver.num_requeued))
    deadline = time.monotonic() + 120
    while mode == "first" or not set(range(NUM_ROWS)) <= trained_numbers(out):
        assert time.monotonic() < deadline, "prompts of the epoch never came back"
        groups = driver.take(P, timeout_s=60)
        time.sleep(0.02)  # "training"
        trained = {
            "numbers": [g.number for g in groups],
            "rows": [g.result["row_index"] for g in groups],
        }
        write_atomic(out / f"trained_{step}.json", trained)
        step += 1
        driver.set_version(step)  # the weights pushed
        write_atomic(ckpt, {"step": step, "rollout": driver.state_dict()})
        if mode == "first" and step == KILL_AFTER_STEP:
            (out / "killable").write_text("")
    driver.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
