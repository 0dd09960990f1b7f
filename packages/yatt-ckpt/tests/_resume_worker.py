"""Tiny deterministic training run for the resume test; run as a script in a fresh process.

    python _resume_worker.py straight N+M OUT         train N+M steps, write final params to OUT
    python _resume_worker.py first N ROOT             train N steps, checkpoint step N under ROOT
    python _resume_worker.py resume M ROOT OUT        fresh process: load ROOT, train M more steps

Every random source a trainer touches is used: dropout (torch global RNG), data order (a seeded
torch.Generator held by a stateful loader), python `random` and numpy's global generator.
"""

import random
import sys

import numpy as np
import torch
from torch import nn

from yatt.ckpt import Checkpointer


class Loader:
    """Shuffled mini-batches from a seeded generator; its state is checkpointed."""

    def __init__(self, data: torch.Tensor, batch_size: int) -> None:
        self.data, self.batch_size = data, batch_size
        self.generator = torch.Generator().manual_seed(1234)
        self.num_batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        self.num_batches_drawn += 1
        order = torch.randperm(len(self.data), generator=self.generator)
        return self.data[order[: self.batch_size]]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def build(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.7)
    data = torch.linspace(-1, 1, 64 * 8).reshape(64, 8)
    loader = Loader(data, batch_size=8)
    return model, optim, sched, loader


def train(model, optim, sched, loader, num_steps: int) -> None:
    for _ in range(num_steps):
        batch = loader.next_batch()
        noise = torch.from_numpy(np.random.standard_normal((8, 1)).astype(np.float32))
        scale = random.uniform(0.5, 1.5)
        loss = (model(batch) - noise).pow(2).mean() * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def main() -> None:
    mode, num_steps = sys.argv[1], int(sys.argv[2])
    if mode == "straight":
        model, optim, sched, loader = build(seed=0)
        train(model, optim, sched, loader, num_steps)
        torch.save(model.state_dict(), sys.argv[3])
        return
    if mode == "first":
        model, optim, sched, loader = build(seed=0)
        train(model, optim, sched, loader, num_steps)
        with Checkpointer(sys.argv[3]) as ckpt:  # async: the write finishes in close()
            ckpt.save(
                num_steps,
                _state(model, optim, sched, loader),
                extra={"batches": loader.num_batches_drawn},
            )
        return
    assert mode == "resume"
    # A different seed: only the checkpoint can make this run continue the first one.
    model, optim, sched, loader = build(seed=777)
    with Checkpointer(sys.argv[3]) as ckpt:
        extra = ckpt.load(_state(model, optim, sched, loader))
    loader.num_batches_drawn = extra["batches"]
    train(model, optim, sched, loader, num_steps)
    torch.save(model.state_dict(), sys.argv[4])


def _state(model, optim, sched, loader) -> dict:
    return {"model": model, "optim": optim, "sched": sched, "loader": loader}


if __name__ == "__main__":
    main()
