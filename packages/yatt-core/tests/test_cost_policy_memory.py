"""The torch policy's memory model in the cost family, on plain numbers: the margin and the cap
chosen from free memory, autocast's copies, the advice per part, the optimizer state on the
host. Expected values from the rules as stated (bytes counted by hand)."""

NUM_GPUS = 0

import pytest

from yatt.core.cost._activation_memory import CAP_MULTIPLE, estimate_activation_bytes
from yatt.core.cost._policy_memory import (
    DEFAULT_MAX_TOKENS,
    MIN_MARGIN_BYTES,
    choose_policy_max_tokens,
    describe_memory_settings,
    estimate_activation_peak_bytes,
    estimate_autocast_copy_bytes,
    with_optimizer_on_host,
)
from yatt.placement import MemoryNeed

GIB = 2**30
SHAPE = {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "vocab_size": 32000}


@pytest.mark.parametrize(
    ("total_gib", "margin_gib"),
    [(80, 4), (20, 2)],  # 5% of 80 GiB is 4 GiB; 5% of 20 GiB (1 GiB) is under the 2 GiB floor
    ids=["fraction", "floor"],
)
def test_the_cap_fits_what_is_left_after_the_step_and_the_margin(total_gib, margin_gib):
    free, to_come = 16 * GIB, 3 * GIB
    cap, margin = choose_policy_max_tokens(
        free, total_gib * GIB, to_come, SHAPE, is_checkpointed=True, is_head_logprobs=True
    )
    assert margin == margin_gib * GIB
    assert margin_gib * GIB >= MIN_MARGIN_BYTES
    budget = free - to_come - margin
    assert cap % CAP_MULTIPLE == 0
    fits = estimate_activation_bytes(cap, SHAPE, is_checkpointed=True)
    over = estimate_activation_bytes(cap + CAP_MULTIPLE, SHAPE, is_checkpointed=True)
    assert fits <= budget < over  # the largest multiple that fits


def test_no_room_is_a_value_error_naming_the_setting():
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=None"):
        choose_policy_max_tokens(
            3 * GIB, 80 * GIB, 0, SHAPE, is_checkpointed=True, is_head_logprobs=True
        )


def test_autocast_copies_two_bytes_a_parameter_unless_float32_or_fsdp2():
    assert estimate_autocast_copy_bytes(1000, is_float32=False, is_fsdp2=False) == 2000
    assert estimate_autocast_copy_bytes(1000, is_float32=True, is_fsdp2=False) == 0
    assert estimate_autocast_copy_bytes(1000, is_float32=False, is_fsdp2=True) == 0


def test_the_peak_is_the_activations_at_the_cap_plus_the_copies():
    kwargs = dict(is_checkpointed=False, is_head_logprobs=True, autocast_copy_bytes=123)
    at_default = estimate_activation_bytes(DEFAULT_MAX_TOKENS, SHAPE, is_checkpointed=False)
    assert estimate_activation_peak_bytes(None, SHAPE, **kwargs) == at_default + 123
    at_512 = estimate_activation_bytes(512, SHAPE, is_checkpointed=False)
    assert estimate_activation_peak_bytes(512, SHAPE, **kwargs) == at_512 + 123
    assert estimate_activation_peak_bytes(512, None, **kwargs) == 0  # unknown shape


def test_the_advice_names_the_cap_and_checkpointing_only_when_off():
    off = describe_memory_settings(4096, is_checkpointed=False)["activations"]
    assert "(now 4096)" in off and "gradient_checkpointing=True" in off
    on = describe_memory_settings(None, is_checkpointed=True)["activations"]
    assert "(now" not in on and "gradient_checkpointing" not in on


@pytest.mark.parametrize(
    ("activations", "expected_peak"),
    [
        (30, {"gradients": 5, "activations": 30}),  # the activations outweigh the state
        (15, {"gradients": 5, "optimizer": 20}),  # the state onloaded for the step is larger
    ],
    ids=["activations", "state"],
)
def test_the_optimizer_on_the_host_leaves_residency_for_the_peak(activations, expected_peak):
    need = MemoryNeed(
        resident={"weights": 10, "optimizer": 20},
        peak={"gradients": 5, "activations": activations, "optimizer step": 7},
        settings={"weights": "w"},
    )
    moved = with_optimizer_on_host(need)
    assert moved.resident == {"weights": 10, "optimizer": 0}
    assert moved.peak == expected_peak
    assert moved.settings == {"weights": "w"}
