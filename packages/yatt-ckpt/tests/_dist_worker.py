"""One rank of the 2-rank test (gloo, CPU): FSDP2-sharded model + AdamW saved by every rank.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python _dist_worker.py ROOT OUT_DIR WRITER

Writes OUT_DIR/full.pt (rank 0: the unsharded model and optimizer state at step 2) and
OUT_DIR/rank{r}.json (what maybe_save reported after only rank 1 got SIGUSR1; with the thread
writer also what when_busy="defer" did while only rank 1's writer was busy).
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from yatt.ckpt import Checkpointer


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: uneven shards


def defer_on_one_busy_rank(root: str, out_dir: str, state: dict) -> list:
    """when_busy="defer" with only rank 1's writer busy: both ranks must defer together."""
    import yatt.ckpt._checkpointer as checkpointer_module

    flag = os.path.join(out_dir, "release")
    if dist.get_rank() == 1:  # rank 1's write thread stays busy after writing until released
        write = checkpointer_module.write_and_commit

        def write_then_hold(*args, **kwargs):
            write(*args, **kwargs)
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)

        checkpointer_module.write_and_commit = write_then_hold
    with Checkpointer(root, every_steps=1, when_busy="defer") as ckpt:
        first = ckpt.maybe_save(1, state)
        second = ckpt.maybe_save(2, state)  # rank 0's writer is free or nearly: it must agree
        if dist.get_rank() == 1:
            open(flag, "w").close()
        ckpt.wait()
        third = ckpt.maybe_save(3, state)
    return [[d.is_saved, d.is_deferred] for d in (first, second, third)]


def main() -> None:
    root, out_dir, writer = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # An explicit CPU mesh: fully_shard would pick CUDA on a GPU host, where this test must
    # still run on CPU with gloo.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    state = {"model": model, "optim": optim}

    with Checkpointer(root, every_steps=100, writer=writer) as ckpt:
        ckpt.install_signal_handlers()
        assert not ckpt.maybe_save(1, state).is_saved
        ckpt.save(2, state, extra={"rank": rank})
        ckpt.wait()
        full_model, full_optim = get_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told to stop
        decision = ckpt.maybe_save(3, state, extra={"rank": rank, "final": True})
    deferred = defer_on_one_busy_rank(root + "-defer", out_dir, state) if writer == "thread" else []
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, os.path.join(out_dir, "full.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        result = {
            "is_saved": decision.is_saved,
            "should_stop": decision.should_stop,
            "stop_signal": decision.stop_signal,
        }
        json.dump(result | {"deferred": deferred}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
