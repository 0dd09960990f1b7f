"""One rank of the per-rank-keyed test: each rank saves only its own shard key (as tensor-parallel
backends do: "model.tp{rank}..."), then loads into zeros and checks what came back."""

import os
import sys

import torch
import torch.distributed as dist

from yatt.ckpt import Checkpointer


def keyed_model(rank: int, fill: float | None) -> torch.nn.Module:
    model = torch.nn.Module()
    shard = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        shard.weight.copy_(torch.arange(6.0).reshape(2, 3) + 10 * rank if fill is None else fill)
    model.add_module(f"tp{rank}", shard)
    return model


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved = keyed_model(rank, None)
    with Checkpointer(root, async_save=False) as ckpt:
        ckpt.save(1, {"model": saved})
        live = keyed_model(rank, 0.0)
        ckpt.load({"model": live})
        assert torch.equal(getattr(live, f"tp{rank}").weight, getattr(saved, f"tp{rank}").weight)
        # A rank-keyed state that no rank asks for is still a different model.
        try:
            ckpt.load({"model": keyed_model(0, 0.0)})
        except ValueError as e:
            assert "the live state lacks" in str(e) and "tp1" in str(e), e
        else:
            raise AssertionError("a stored shard no rank loads must be reported")
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
