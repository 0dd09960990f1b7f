import contextlib

import pytest
import torch
import torch.distributed as dist

from yatt.placement import _regions
from yatt.placement._backends import CpuBookkeepingBackend


@pytest.fixture
def cpu_regions(monkeypatch: pytest.MonkeyPatch) -> _regions._Registry:
    """A fresh registry on the bookkeeping backend, so tests share no tags (even on a GPU host)."""
    registry = _regions._Registry(CpuBookkeepingBackend())
    monkeypatch.setattr(_regions, "_REGISTRY", registry)
    return registry


@pytest.fixture
def fresh_regions(monkeypatch: pytest.MonkeyPatch) -> _regions._Registry:
    """A fresh registry that picks its backend as a user's would (CUDA when available)."""
    registry = _regions._Registry()
    monkeypatch.setattr(_regions, "_REGISTRY", registry)
    return registry


# -- FSDP2 on a one-rank process group (test_offload_fsdp2.py, test_cuda.py) ------------------
@contextlib.contextmanager
def one_rank_group(tmp_path, backend: str = "gloo"):
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model_and_optimizer(
    device: str, width: int = 32
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, 4),
    ).to(device)
    mesh = init_device_mesh(device, (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=generator).to(device)
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


@pytest.fixture
def fsdp2():
    """(one_rank_group, sharded_model_and_optimizer, train_step) for FSDP2 offload tests."""
    return one_rank_group, sharded_model_and_optimizer, train_step
