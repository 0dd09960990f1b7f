"""Optimisation settings of the policy configs: the learning-rate schedule against its closed
form, range checks naming the field (both backends' configs), the scheduled lr in the step's
metrics, a bit-exact resume of schedule and weights, weight decay off biases and norms, and
grad_clip=0 as no clipping."""

import copy
import itertools

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from yatt.core import (
    Batch,
    MegatronPolicyConfig,
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    compute_lr,
)

NUM_GPUS = 0
COSINE = {"lr_schedule": "cosine", "num_warmup_steps": 2, "num_decay_steps": 6}


def _schedule_kwargs(settings):
    """Config fields as compute_lr's keywords (lr_schedule is its `schedule`)."""
    return {("schedule" if k == "lr_schedule" else k): v for k, v in settings.items()}


@pytest.mark.parametrize(
    ("step", "kwargs", "expected"),
    [
        pytest.param(0, {}, 1.0, id="constant"),
        pytest.param(0, {"num_warmup_steps": 4}, 0.25, id="warmup-first"),
        pytest.param(3, {"num_warmup_steps": 4}, 1.0, id="warmup-last"),
        pytest.param(9, {"num_warmup_steps": 4}, 1.0, id="constant-after-warmup"),
        pytest.param(2, COSINE, 1.0, id="cosine-start"),
        pytest.param(4, COSINE, 0.5, id="cosine-middle"),
        # cos(3 pi / 4) = -sqrt(2) / 2
        pytest.param(5, COSINE | {"min_lr_ratio": 0.2}, 0.2 + 0.4 * (1 - 2**0.5 / 2), id="3/4"),
        pytest.param(6, COSINE | {"min_lr_ratio": 0.2}, 0.2, id="cosine-end"),
        pytest.param(60, COSINE, 0.0, id="after-decay"),
    ],
)
def test_lr_schedule_closed_form(step, kwargs, expected):
    assert compute_lr(step, lr=1.0, **_schedule_kwargs(kwargs)) == pytest.approx(
        expected, abs=1e-12
    )


def test_cosine_decreases_monotonically_to_its_floor():
    lrs = [compute_lr(t, lr=1e-3, **_schedule_kwargs(COSINE), min_lr_ratio=0.1) for t in range(10)]
    ratios = [lr / 1e-3 for lr in lrs]
    assert ratios[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(ratios[1:]))
    assert ratios[6:] == pytest.approx([0.1] * 4)


@pytest.mark.parametrize("config_cls", [TorchPolicyConfig, MegatronPolicyConfig])
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param({"lr": -1.0}, r"\.lr=-1\.0", id="lr"),
        pytest.param({"lr_schedule": "linear"}, r"\.lr_schedule='linear'", id="schedule"),
        pytest.param({"num_warmup_steps": -1}, r"\.num_warmup_steps=-1", id="warmup"),
        pytest.param({"lr_schedule": "cosine"}, r"\.num_decay_steps=None.*cosine", id="no-decay"),
        pytest.param(
            {"lr_schedule": "cosine", "num_decay_steps": 3, "num_warmup_steps": 3},
            r"\.num_decay_steps=3.*> num_warmup_steps \(3\)",
            id="decay-within-warmup",
        ),
        pytest.param(
            {"lr_schedule": "cosine", "num_decay_steps": 9, "min_lr_ratio": 1.5},
            r"\.min_lr_ratio=1\.5: must be in \[0, 1\]",
            id="ratio",
        ),
        pytest.param({"num_decay_steps": 9}, r"\.num_decay_steps=9 applies to", id="unused-decay"),
        pytest.param({"min_lr_ratio": 0.1}, r"\.min_lr_ratio=0\.1 applies to", id="unused-ratio"),
        pytest.param({"weight_decay": -0.1}, r"\.weight_decay=-0\.1", id="weight-decay"),
        pytest.param({"grad_clip": float("inf")}, r"\.grad_clip=inf", id="grad-clip"),
        pytest.param({"betas": (0.9, 1.0)}, r"\.betas=", id="betas"),
    ],
)
def test_bad_optimisation_settings_name_the_field(tiny_model_dir, config_cls, overrides, match):
    with pytest.raises(ValueError, match=config_cls.__name__ + match):
        config_cls(model_dir=tiny_model_dir, **overrides)


def test_good_settings_are_accepted_by_both_configs(tiny_model_dir):
    settings = COSINE | {"min_lr_ratio": 0.1, "weight_decay": 0.01, "grad_clip": 0.0}
    for config_cls in (TorchPolicyConfig, MegatronPolicyConfig):
        assert config_cls(model_dir=tiny_model_dir, **settings).num_decay_steps == 6


def _config(model_dir, **overrides):
    base = {"model_dir": model_dir, "lr": 1e-3, "dtype": "float32", "parallel": "none"}
    return TorchPolicyConfig(**(base | overrides))


def _batch(advantages=None):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, length in enumerate((6, 13, 4, 9)):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[2:] = 1
        ids = torch.randint(5, 200, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "group_id": i // 2, "reward": i % 3})
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(
        batch["reward"].float(), batch["group_id"]
    )
    if advantages is not None:
        batch.samples["advantages"] = torch.tensor(advantages, dtype=torch.float32)
    return batch


def _steps(policy, num_steps):
    loss = PolicyLoss(is_on_policy=True)
    return [policy.train_step(_batch(), loss)["lr"] for _ in range(num_steps)]


def test_resume_continues_the_schedule_and_the_weights_bit_exactly(tiny_model_dir):
    config = _config(tiny_model_dir, **COSINE, min_lr_ratio=0.1, weight_decay=0.01)
    uninterrupted = TorchPolicy(config)
    lrs = _steps(uninterrupted, 5)
    kwargs = _schedule_kwargs(COSINE) | {"min_lr_ratio": 0.1}
    assert lrs == [compute_lr(t, lr=1e-3, **kwargs) for t in range(5)]

    first = TorchPolicy(config)
    assert _steps(first, 3) == lrs[:3]
    # What yatt.ckpt saves and loads: module and optimizer through DCP's state_dict, the
    # schedule as a Stateful (deep copies stand in for the files).
    state = first.state()
    assert set(state) == {"model", "optimizer", "schedule"}
    assert isinstance(state["schedule"], Stateful)
    model_sd, optim_sd = copy.deepcopy(get_state_dict(state["model"], state["optimizer"]))
    schedule_sd = copy.deepcopy(state["schedule"].state_dict())
    del first

    resumed = TorchPolicy(config)
    loaded = resumed.state()
    set_state_dict(
        loaded["model"], loaded["optimizer"], model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    loaded["schedule"].load_state_dict(schedule_sd)
    assert resumed.num_steps == 3
    assert _steps(resumed, 2) == lrs[3:]
    for (name, got), (_, want) in zip(
        resumed.named_weights(), uninterrupted.named_weights(), strict=True
    ):
        assert torch.equal(got, want), name


def test_weight_decay_shrinks_matrices_only(tiny_model_dir):
    # Zero advantages: zero gradients, so Adam's update is 0 and only the decay moves weights.
    policy = TorchPolicy(_config(tiny_model_dir, weight_decay=0.5, lr=0.1))
    before = {name: t.clone() for name, t in policy.named_weights()}
    metrics = policy.train_step(_batch(advantages=[0.0] * 4), PolicyLoss(is_on_policy=True))
    assert metrics["is_skipped"] == 0.0 and metrics["grad_norm"] == 0.0
    for name, tensor in policy.named_weights():
        if tensor.ndim >= 2:
            torch.testing.assert_close(tensor, before[name] * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)
        else:  # norm weights (and biases): no decay
            assert torch.equal(tensor, before[name]), name


def test_grad_clip_zero_is_no_clipping(tiny_model_dir):
    results = []
    for grad_clip in (0.0, None, 1e-3):
        policy = TorchPolicy(_config(tiny_model_dir, grad_clip=grad_clip))
        metrics = policy.train_step(_batch(), PolicyLoss(is_on_policy=True))
        results.append((metrics["grad_norm"], dict(policy.named_weights())))
    (norm_zero, zero), (norm_none, none), (norm_tiny, tiny) = results
    assert norm_zero == norm_none == norm_tiny > 1e-3  # the norm before clipping, always
    assert all(torch.equal(zero[name], none[name]) for name in zero)
    # A real clip scales the gradients down, which Adam's eps turns into a different step.
    assert any(not torch.equal(tiny[name], none[name]) for name in none)
