"""kill -9 a saving process at random moments: the newest committed checkpoint always loads and
equals what was saved at its step."""

NUM_GPUS = 0

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from yatt.ckpt import Checkpointer
from yatt.ckpt._layout import list_committed_steps

WORKER = Path(__file__).with_name("_crash_worker.py")


def load_worker():
    spec = importlib.util.spec_from_file_location("_crash_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_kill_9_at_random_moments_never_loses_the_newest_checkpoint(tmp_path):
    worker = load_worker()
    seed = int(os.environ.get("YATT_CKPT_CRASH_SEED", "2026"))
    rng = random.Random(seed)
    num_kills = 24
    zygote = Zygote()
    newest_seen = None
    try:
        for i in range(num_kills):
            mode = "sync" if i % 3 == 0 else "async"
            reply = zygote.ask(f"fork {tmp_path} {mode}")
            assert reply.startswith("pid "), reply
            pid = int(reply.split()[1])
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            assert zygote.ask(f"reap {pid}") == f"reaped {pid}"

            # step=newest: no fallback to an older checkpoint; a damaged newest one raises.
            with Checkpointer(tmp_path) as ckpt:
                newest = ckpt.latest()
                context = f"kill {i} (seed {seed}, mode {mode}): newest {newest}"
                if newest is None:
                    assert newest_seen is None, context
                    continue
                assert newest_seen is None or newest >= newest_seen, context
                newest_seen = newest
                state = {k: torch.zeros_like(v) for k, v in worker.expected_state(0).items()}
                assert ckpt.load(state, step=newest) == {"step": newest}, context
                ckpt.verify(newest)
            for key, value in worker.expected_state(newest).items():
                assert torch.equal(state[key], value), f"{context}: {key}"
            leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            assert not leftovers, f"{context}: start-up left {leftovers}"
    finally:
        zygote.close()
    # The kills must not all have landed before the first commit, or the test proved nothing.
    assert newest_seen is not None and newest_seen >= num_kills // 2, newest_seen


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_of_a_trainer_with_a_process_writer_leaves_no_orphan(tmp_path):
    worker = load_worker()
    rng = random.Random(int(os.environ.get("YATT_CKPT_CRASH_SEED", "2026")))
    zygote = Zygote()
    try:
        for i in range(2):
            before = max(list_committed_steps(tmp_path), default=0)
            pid = int(zygote.ask(f"fork {tmp_path} process").split()[1])
            # Kill while the writer process is saving: after it committed at least one step.
            deadline = time.monotonic() + 60
            # Read the folder only: building a Checkpointer would delete the save in progress.
            while max(list_committed_steps(tmp_path), default=0) <= before:
                assert time.monotonic() < deadline, f"kill {i}: the process writer never committed"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.3))
            writers = children_of(pid)
            assert writers, f"kill {i}: no writer process under the trainer"
            os.kill(pid, signal.SIGKILL)
            assert zygote.ask(f"reap {pid}") == f"reaped {pid}"
            # A writer polls its parent every _PARENT_POLL_SECONDS; the bound leaves room for a
            # loaded machine (5 s was missed by 50 ms on 2 busy cores). An orphan never exits.
            deadline = time.monotonic() + 30
            while any(is_running(w) for w in writers):
                assert time.monotonic() < deadline, (
                    f"kill {i}: writers {writers} outlived the trainer"
                )
                time.sleep(0.05)
            with Checkpointer(tmp_path) as ckpt:
                newest = ckpt.latest()
                state = {k: torch.zeros_like(v) for k, v in worker.expected_state(0).items()}
                assert ckpt.load(state, step=newest) == {"step": newest}, f"kill {i}"
            for key, value in worker.expected_state(newest).items():
                assert torch.equal(state[key], value), f"kill {i}: {key}"
    finally:
        zygote.close()
