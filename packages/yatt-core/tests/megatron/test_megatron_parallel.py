NUM_GPUS = 0

"""MegatronPolicy at pipeline-parallel and packed layouts against pp=1 padded, on CPU (gloo,
2 ranks; see _cpu_shim.py): Megatron-Core's 1F1B and interleaved schedules, and rows packed
end to end (THD), give pp=1's logprobs, losses, gradients and updated weights; named_weights
gives the whole model on every stage; the model state is keyed by global layer, so each
stage's keys together are pp=1's. Skipped without megatron-core."""

import json

import pytest
import torch

PP1 = json.dumps({}, sort_keys=True)
PIPELINES = [
    json.dumps({"pp_size": 2}, sort_keys=True),
    json.dumps({"pp_size": 2, "virtual_pp_size": 2}, sort_keys=True),
    json.dumps({"pp_size": 2, "pack_sequences": True}, sort_keys=True),
    json.dumps({"pp_size": 2, "recompute_granularity": "full"}, sort_keys=True),
]
PACKED = json.dumps({"pack_sequences": True}, sort_keys=True)
CP2 = json.dumps({"cp_size": 2}, sort_keys=True)
CP2_RECOMPUTE = json.dumps({"cp_size": 2, "recompute_granularity": "full"}, sort_keys=True)


@pytest.fixture(params=PIPELINES, ids=["1f1b", "interleaved", "1f1b-packed", "1f1b-recompute"])
def pipeline(request, megatron_layout_results):
    return megatron_layout_results[PP1][0], megatron_layout_results[request.param]


def test_packed_rows_give_the_padded_logprobs_losses_gradients_and_step(
    megatron_layout_results,
):
    reference = megatron_layout_results[PP1][0]
    for packed in megatron_layout_results[PACKED]:  # pp=1, dp=2: both ranks the same batch
        torch.testing.assert_close(packed["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)
        for got, want in zip(packed["metrics"], reference["metrics"], strict=True):
            for key in ("loss", "grad_norm", "pg_loss", "entropy", "num_loss_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(packed["grads"][name], grad, atol=3e-5, rtol=1e-4)
        for name, tensor in reference["weights"].items():
            # Adam moves an element whose gradient is at rounding level by up to ~lr (1e-3)
            # when the summation order changes; a wrong gradient moves most of them by ~lr.
            torch.testing.assert_close(packed["weights"][name], tensor, atol=5e-4, rtol=0)


def test_packing_reports_the_padding_it_saved(megatron_layout_results):
    """Per micro-batch, the padded layout computes rows x longest row tokens; packed, only the
    real ones. The metric sums the difference over the micro-batches and the DP ranks."""
    per_rank = []
    for packed in megatron_layout_results[PACKED]:
        lengths = packed["lengths"]
        per_rank.append(
            sum(
                len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b)
                for b in packed["bins"]
            )
        )
        # Packing bounds the real tokens of a micro-batch (64 here), not rows x longest.
        assert all(sum(lengths[i] for i in b) <= 64 or len(b) == 1 for b in packed["bins"])
    assert sum(per_rank) > 0
    for packed in megatron_layout_results[PACKED]:
        assert [m["num_padding_tokens_saved"] for m in packed["metrics"]] == [sum(per_rank)] * 2
    assert "num_padding_tokens_saved" not in megatron_layout_results[PP1][0]["metrics"][0]


def test_pipeline_logprobs_equal_pp1_on_every_stage(pipeline):
    reference, stages = pipeline
    for stage in stages:  # the last stage's, broadcast: every rank gets them
        torch.testing.assert_close(stage["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)
    assert reference["logprobs"].abs().sum() > 0


def test_pipeline_losses_gradients_and_step_equal_pp1(pipeline):
    reference, stages = pipeline
    for stage in stages:
        for got, want in zip(stage["metrics"], reference["metrics"], strict=True):
            # The global normalisation: loss, metrics and norm as one rank computes them.
            for key in ("loss", "grad_norm", "pg_loss", "entropy", "is_weight"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            # The rollout weights' max (1.5 by construction): a max over micro-batches and
            # ranks, not a sum, in every layout.
            assert got["is_weight_max"] == want["is_weight_max"] == pytest.approx(1.5, rel=1e-6)
            # pp=1 ran dp=2 on the same batch: twice the tokens, the same means.
            assert 2 * got["num_loss_tokens"] == want["num_loss_tokens"]
        assert stage["metrics"][0]["loss"] != stage["metrics"][1]["loss"]  # the step moved
    # Each stage holds its own layers' gradients (global names); together, pp=1's.
    grads = [stage["grads"] for stage in stages]
    assert not set(grads[0]) & set(grads[1])
    merged = {**grads[0], **grads[1]}
    assert set(merged) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(merged[name], grad, atol=3e-5, rtol=1e-4, msg=name)
    assert "embedding.word_embeddings.weight" in grads[0]
    assert "output_layer.weight" in grads[1]


def test_named_weights_gives_the_whole_updated_model_on_every_stage(pipeline):
    reference, stages = pipeline
    for stage in stages:
        assert set(stage["weights"]) == set(reference["weights"])
        for name, tensor in reference["weights"].items():
            # Two Adam steps of lr 1e-3 from equal gradients: equal up to summation order, which
            # moves an element with a rounding-level gradient by up to ~lr.
            torch.testing.assert_close(stage["weights"][name], tensor, atol=5e-4, rtol=0, msg=name)


def test_model_state_is_keyed_by_global_layer_and_reshards_across_pp(pipeline):
    reference, stages = pipeline
    keys = [set(stage["model_state"]) for stage in stages]
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == set(reference["model_state"])
    for stage in stages:
        # Loading the whole pipeline's state (what a pp=1 run saved has the same keys) worked.
        assert stage["merged_model_keys"] == sorted(reference["model_state"])
        for key, value in stage["model_state"].items():
            torch.testing.assert_close(value, reference["model_state"][key], atol=5e-4, rtol=0)


def test_optimizer_state_of_another_layout_is_refused(pipeline):
    _, stages = pipeline
    for stage in stages:
        assert "another (tp, pp, cp, dp) layout" in stage["foreign_optimizer_error"]
        assert any(key.startswith(f"tp0.pp{stage['pp_rank']}.") for key in stage["optimizer_keys"])


@pytest.mark.parametrize("layout", [CP2, CP2_RECOMPUTE], ids=["cp2", "cp2-recompute"])
def test_context_parallel_gives_pp1_logprobs_losses_gradients_and_step(
    megatron_layout_results, layout
):
    """cp=2: each rank runs two of four chunks of every row (all-gathered keys and values);
    the gathered logprobs, the global loss and each rank's gradient share (DDP averages over
    dp x cp) give one rank's numbers. With full recompute too."""
    reference = megatron_layout_results[PP1][0]
    for rank in megatron_layout_results[layout]:
        torch.testing.assert_close(rank["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)
        for got, want in zip(rank["metrics"], reference["metrics"], strict=True):
            for key in ("loss", "grad_norm", "pg_loss", "entropy", "is_weight"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            # The rollout weights' max (1.5 by construction): a max over micro-batches and
            # ranks, not a sum, in every layout.
            assert got["is_weight_max"] == want["is_weight_max"] == pytest.approx(1.5, rel=1e-6)
            # cp=2 is one DP rank (pp=1 here ran dp=2 on the same batch).
            assert 2 * got["num_loss_tokens"] == want["num_loss_tokens"]
        assert set(rank["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(rank["grads"][name], grad, atol=3e-5, rtol=1e-4, msg=name)
        for name, tensor in reference["weights"].items():
            torch.testing.assert_close(rank["weights"][name], tensor, atol=5e-4, rtol=0, msg=name)


def test_a_checkpoint_loads_its_model_at_another_pp_size_and_refuses_its_optimizer(
    megatron_layout_results,
):
    """Through torch.distributed.checkpoint (what yatt.ckpt writes): saved at pp=2 and loaded at pp=1, then the other way. The
    model state alone loads (each stage reads its layers by global name), giving the saving
    run's weights; the whole state fails on every rank, naming this run's pp_size, before any
    tensor is read."""
    for rank in megatron_layout_results["checkpoints"]:
        for loaded, saved, now in (
            (rank["pp1"], rank["pp2"], "pp_size=1"),
            (rank["pp2_again"], rank["pp1"], "pp_size=2"),
        ):
            assert "layout(" in loaded["whole_load_error"]
            assert now in loaded["whole_load_error"]
            assert set(loaded["loaded_weights"]) == set(saved["saved_weights"])
            for name, tensor in saved["saved_weights"].items():
                assert torch.equal(loaded["loaded_weights"][name], tensor), name
        # The step after the load moved the weights (the saved state is not the initial one).
        first = next(iter(rank["pp2"]["saved_weights"]))
        assert not torch.equal(
            rank["pp1"]["saved_weights"][first], rank["pp2"]["saved_weights"][first]
        )
