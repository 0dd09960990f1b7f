"""FSDP2 modules and their optimizers offload through `.to()` (see _offload_dtensor).

On CPU the move is host to host, so these tests cover the bookkeeping and that training goes on
exactly as without an offload; test_cuda.py checks that the GPU memory comes back.
"""

import pytest
import torch

from yatt.placement import TrainerRole, is_offloaded, offload, onload
from yatt.placement._offload import _OFFLOADED

NUM_GPUS = 0

pytest.importorskip("torch.distributed.fsdp")


def test_fsdp2_offload_onload_keeps_objects_and_training_identical(tmp_path, fsdp2):
    one_rank_group, sharded_model_and_optimizer, train_step = fsdp2
    with one_rank_group(tmp_path):
        model, optimizer = sharded_model_and_optimizer("cpu")
        twin, twin_optimizer = sharded_model_and_optimizer("cpu")
        train_step(model, optimizer, 1)
        train_step(twin, twin_optimizer, 1)
        params = list(model.parameters())

        role = TrainerRole(model, optimizer)
        role.sleep()
        assert is_offloaded(model) and is_offloaded(optimizer)
        assert _OFFLOADED[model].by_to and _OFFLOADED[optimizer].by_to
        assert _OFFLOADED[model].num_bytes > 0 and _OFFLOADED[optimizer].num_bytes > 0
        with pytest.raises(RuntimeError, match="already offloaded"):
            offload(model)
        role.wake_up()
        assert not is_offloaded(model) and not is_offloaded(optimizer)
        with pytest.raises(RuntimeError, match="not offloaded"):
            onload(model)

        # Same Parameter objects: the optimizer still steps the module's parameters.
        assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
        for seed in (2, 3):
            train_step(model, optimizer, seed)
            train_step(twin, twin_optimizer, seed)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor())


def test_optimizer_without_state_yet_offloads_as_a_plain_one(tmp_path, fsdp2):
    one_rank_group, sharded_model_and_optimizer, train_step = fsdp2
    with one_rank_group(tmp_path):
        model, optimizer = sharded_model_and_optimizer("cpu")
        offload(optimizer)  # no state before the first step: nothing sharded to move
        assert not _OFFLOADED[optimizer].by_to and _OFFLOADED[optimizer].num_bytes == 0
        onload(optimizer)
        train_step(model, optimizer, 1)
        assert optimizer.state
