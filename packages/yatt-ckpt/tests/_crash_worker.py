"""A zygote for the kill -9 test: imports torch once, then forks one saving child per request.

Protocol on stdin/stdout, one line each:
    fork ROOT MODE    ->  "pid PID"      a child resumes from ROOT's newest checkpoint (if any) and
                                         saves steps last+1, last+2, ... forever (MODE async|sync|process)
    reap PID          ->  "reaped PID"   after the parent SIGKILLed it
    quit

Forking a process that already imported torch makes each kill cheap (no 4 s import); the zygote
itself never runs torch ops, so the children start from a clean state.
"""

import os
import sys

import torch

from yatt.ckpt import Checkpointer


def expected_state(step: int) -> dict[str, torch.Tensor]:
    """The state every child saves at `step`: ~4 MB, so a save spans many syscalls."""
    gen = torch.Generator().manual_seed(step)
    return {
        "weight": torch.randn(1024, 512, generator=gen),
        "bias": torch.randn(512, generator=gen),
        "step": torch.tensor([step], dtype=torch.int64),
    }


def run_child(root: str, mode: str) -> None:
    torch.set_num_threads(1)
    state = {k: torch.zeros_like(v) for k, v in expected_state(0).items()}
    writer = "process" if mode == "process" else "thread"
    with Checkpointer(root, keep_last=2, async_save=(mode != "sync"), writer=writer) as ckpt:
        last = ckpt.latest()
        if last is not None:
            assert ckpt.load(state) == {"step": last}
        step = 0 if last is None else last
        while True:
            step += 1
            for key, value in expected_state(step).items():
                state[key].copy_(value)
            ckpt.save(step, state, extra={"step": step})


def main() -> None:
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    run_child(*args)
                finally:
                    os._exit(1)
            print(f"pid {pid}", flush=True)
        elif cmd == "reap":
            os.waitpid(int(args[0]), 0)
            print(f"reaped {args[0]}", flush=True)
        else:
            return


if __name__ == "__main__":
    main()
