"""LoRA under DDP and FSDP2 on two gloo ranks: the adapter's step equals a single-process step
on the whole batch, the ranks agree, the reference pass (adapter off) is the base's, and a
checkpoint of the adapter (sharded under FSDP2) resumes exactly."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from yatt.core import TorchPolicy

NUM_GPUS = 0
WORKERS = Path(__file__).with_name("_lora_workers.py")
_spec = importlib.util.spec_from_file_location("_lora_workers", WORKERS)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


def _launch(parallel: str, out_dir: Path, model_dir: str, saved: tuple[str, ...]) -> list[dict]:
    from yatt.testing import run_ranks

    out_dir.mkdir()
    args = [sys.executable, str(WORKERS), parallel, str(out_dir), model_dir]
    args += [",".join(saved)] if saved else []
    run_ranks(args, 2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=180)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("saved", [(), ("lm_head",)], ids=["adapter", "adapter+head"])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_lora_steps_under_data_parallel_equal_one_process(
    tiny_model_dir, tmp_path, parallel, saved
):
    """saved: modules_to_save (the LM head trained whole beside the adapter)."""
    pytest.importorskip("yatt.ckpt")  # a sibling: installed beside yatt-core, not by it
    ranks = _launch(parallel, tmp_path / parallel, tiny_model_dir, saved)
    # The reference: one process, the whole batch in one micro-batch.
    config = workers.lora_config(tiny_model_dir, "none", max_tokens=10_000, modules_to_save=saved)
    one = TorchPolicy(config)
    ref = workers.run_lora_steps(one, workers.make_global_batch())
    assert ref["live"] == "parameters"
    for rank, out in enumerate(ranks):
        assert out["num_optimizer_params"] == ref["num_optimizer_params"]
        # an engine can bind a process's own parameters, never FSDP2's shards
        if parallel == "ddp":
            assert out["live"] == "parameters"
        else:
            assert "FSDP2 shards" in out["live"]
        for got, expected in zip(out["metrics"], ref["metrics"], strict=True):
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            assert got["num_micro_batches"] > 1  # the token cap forced accumulation
        shard = workers.SHARDS[2][rank]
        width = out["reference"].shape[1]
        torch.testing.assert_close(
            out["reference"], ref["reference"][shard, :width], atol=1e-5, rtol=0
        )
        for name, tensor in ref["adapter"].items():
            # Adam moves each entry by about lr (1e-2) a step; float noise near-zero grads.
            torch.testing.assert_close(out["adapter"][name], tensor, atol=1e-4, rtol=0)
        for name, tensor in ref["merged"].items():
            torch.testing.assert_close(out["merged"][name], tensor, atol=1e-4, rtol=0)
    for name, tensor in ranks[0]["adapter"].items():
        assert torch.equal(tensor, ranks[1]["adapter"][name]), name
    for out in ranks:  # the resumed policy's next step is the uninterrupted one, bit for bit
        for name, tensor in out["third"].items():
            assert torch.equal(out["resumed_third"][name], tensor), name
            assert not torch.equal(out["adapter"][name], tensor) or name.endswith("scaling")
    # The steps moved the adapter's B away from its zero start: not a comparison of no-ops.
    moved = [n for n, t in ref["adapter"].items() if n.endswith(".lora_B") and t.abs().max() > 0]
    assert len(moved) == 14
    if saved:  # the head is synced whole, and trained
        head = ref["adapter"]["lm_head.weight.lora_saved"]
        assert not torch.equal(head, one.module.get_parameter("lm_head.original_module.weight"))
