"""Train N, save, resume in a new process, train M == train N+M straight, bitwise on CPU."""

NUM_GPUS = 0

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from yatt.ckpt import Checkpointer

WORKER = Path(__file__).with_name("_resume_worker.py")


def load_worker():
    spec = importlib.util.spec_from_file_location("_resume_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_is_bitwise_exact(tmp_path):
    worker = load_worker()
    num_first, num_more = 5, 6
    root, resumed_out = tmp_path / "ckpt", tmp_path / "resumed.pt"
    model, optim, sched, loader = worker.build(seed=0)
    worker.train(model, optim, sched, loader, num_first + num_more)
    straight = model.state_dict()

    # The same run with a checkpoint at step N: saving must not perturb it.
    model, optim, sched, loader = worker.build(seed=0)
    worker.train(model, optim, sched, loader, num_first)
    at_n = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(root) as ckpt:
        state = {"model": model, "optim": optim, "sched": sched, "loader": loader}
        ckpt.save(num_first, state, extra={"batches": loader.num_batches_drawn})
        worker.train(model, optim, sched, loader, num_more)
    for key, value in model.state_dict().items():
        assert torch.equal(straight[key], value), key

    # A new process: nothing survives but what the checkpoint holds.
    subprocess.run(
        [sys.executable, str(WORKER), "resume", str(num_more), str(root), str(resumed_out)],
        check=True,
        timeout=300,
    )
    resumed = torch.load(resumed_out)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    assert not torch.equal(at_n["0.weight"], resumed["0.weight"]), "training moved the weights"
