"""Two gloo ranks: DDP/FSDP2 steps equal a single-process step on the concatenated batch, and
no rank holds another rank's prompt payloads except the samples balancing moved to it."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from yatt.core import PolicyLoss, TorchPolicy

NUM_GPUS = 0

_spec = importlib.util.spec_from_file_location("_workers", Path(__file__).with_name("_workers.py"))
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


RUNS = [("ddp", "token_mean"), ("ddp", "seq_mean_token_mean"), ("fsdp2", "token_mean")]


@pytest.mark.slow
def test_data_parallel_steps_equal_single_process_step(launch, tiny_model_dir):
    """DDP and FSDP2 on two gloo ranks, uneven shards, several micro-batches each."""
    ranks = launch("policy", 2, model_dir=tiny_model_dir, runs=RUNS)
    initial = TorchPolicy(workers.policy_config(tiny_model_dir, "none", max_tokens=10_000))
    initial_weights = dict(initial.named_weights())
    references = {}
    for run in RUNS:
        aggregation = run[1]
        if aggregation not in references:
            # The reference: one process, the whole batch, one big micro-batch.
            config = workers.policy_config(tiny_model_dir, "none", max_tokens=10_000)
            loss_fn = PolicyLoss(aggregation=aggregation, clip_high=0.28)
            references[aggregation] = workers.run_policy_step(
                TorchPolicy(config), workers.make_global_batch(), loss_fn
            )
        ref = references[aggregation]
        for rank, result in enumerate(ranks):
            out = result[run]
            metrics, ref_metrics = out["metrics"], ref["metrics"]
            assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-6)
            # The norm is scale-sensitive where Adam's first step is not.
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
            assert metrics["num_loss_tokens"] == ref_metrics["num_loss_tokens"]
            assert metrics["num_micro_batches"] > 1  # the token cap forced accumulation
            # Padded, micro-batched logprobs equal the single-process ones, sample by sample.
            shard = workers.SHARDS[2][rank]
            width = out["old_logprobs"].shape[1]
            torch.testing.assert_close(
                out["old_logprobs"], ref["old_logprobs"][shard, :width], atol=1e-5, rtol=0
            )
            for name, tensor in ref["weights"].items():
                # Adam moves each weight by about lr (1e-3); near-zero grads amplify float noise.
                torch.testing.assert_close(out["weights"][name], tensor, atol=1e-4, rtol=0)
        for name, tensor in ranks[0][run]["weights"].items():
            assert torch.equal(tensor, ranks[1][run]["weights"][name]), (run, name)
        # The step moved the weights: the comparison is not between two untouched models.
        moved = [n for n, t in initial_weights.items() if not torch.equal(t, ref["weights"][n])]
        assert len(moved) > len(initial_weights) // 2
    assert ranks[1]["logprobs_with_empty_rank"].shape == (0, 0)


def _write_image_rows(path: Path, num_rows: int) -> None:
    with open(path, "w") as f:
        for i in range(num_rows):
            f.write(json.dumps({"prompt": f"q{i}", "image": workers._image_hex(i)}) + "\n")


@pytest.mark.slow
def test_parallel_controller_keeps_payloads_on_their_rank(launch, tmp_path):
    data = tmp_path / "prompts.jsonl"
    _write_image_rows(data, 40)
    ranks = launch("controller", 2, data=str(data), batch_size=6)
    own = [set(out["own"]) for out in ranks]
    assert not own[0] & own[1] and all(len(o) == 6 for o in own)
    for rank, out in enumerate(ranks):
        # Each rank parsed only its own rows (6, one twice for the key check), never another's.
        assert out["num_rows_parsed"] == 7
        held = set(out["held"])
        moved_in = held - own[rank]
        # Anything held that this rank did not load came from the other rank, by balancing.
        assert moved_in <= own[1 - rank]
        moved_out = own[rank] - held
        assert moved_out == set(ranks[1 - rank]["held"]) - own[1 - rank]
        assert out["held_images_ok"]
        # restore brings every sample home, in order, with the fields added on the way.
        assert out["restored_rows"] == out["own"]
        assert out["restored_scores"] == [2.0 * r for r in out["own"]]
        assert out["metrics"] == {"n": 12.0, "rank": 1.0}
    # Rank 0's samples were much longer: balancing moved some and evened the tokens.
    assert ranks[0]["held"] != ranks[0]["own"]
    before = [out["tokens_before"] for out in ranks]
    after = [out["tokens_after"] for out in ranks]
    assert max(after) - min(after) < max(before) - min(before)
    # Batch.rebalance's tolerance: kept within 10%, evened out at 0.
    assert [out["tokens_at_tolerance_0.1"] for out in ranks] == [42, 38]
    assert [out["tokens_at_tolerance_0.0"] for out in ranks] == [40, 40]
    # Dynamic sampling ran the same rounds on both ranks although rank 0 filled at once.
    assert len(ranks[0]["ds_rounds"]) == len(ranks[1]["ds_rounds"]) == 6
    assert ranks[0]["ds_rounds"][2:] == [0, 0, 0, 0]
    assert ranks[0]["ds_stats"]["is_filled"] == ranks[1]["ds_stats"]["is_filled"] == 1.0
