"""The built-in engine as a placement role: memory tags in a plan, and KV-cache sizing by share."""

NUM_GPUS = 0

import asyncio
import math

import pytest
import torch

from yatt.placement import MemorySplit, Plan, TrainerRole, is_paused, resident_bytes
from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.builtin._kv_budget import slots_for_fraction
from yatt.testing import make_tiny_causal_lm

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [40, 41, 42, 43], [50, 51]]
SAMPLING = SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=12, seed=7)
MAX_SEQ_LEN = 64


def _requests():
    return [Request(prompt_ids=list(p)) for p in PROMPTS]


def _device_bytes_for(engine: BuiltinEngine, num_slots: int, fraction: float) -> int:
    """A notional device on which `fraction` holds the weights and exactly `num_slots` slots."""
    layout = engine._kv_layout
    share = engine._weight_bytes + layout.fixed_bytes + num_slots * layout.slot_bytes
    return math.ceil(share / fraction)


def _engine(model_dir, prefix, *, max_batch_size=8, device_memory_bytes=None):
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_seq_len=MAX_SEQ_LEN,
        region_prefix=prefix,
        device_memory_bytes=device_memory_bytes,
    )
    return BuiltinEngine(model_dir, config=config)


@pytest.fixture(scope="module")
def sized_engine(tiny_model_dir):
    """An engine on a notional device where a share of 0.5 holds exactly 4 slots."""
    probe = _engine(tiny_model_dir, "split-probe")
    device_bytes = _device_bytes_for(probe, 4, 0.5)
    probe.close()
    engine = _engine(tiny_model_dir, "split-sized", device_memory_bytes=device_bytes)
    yield engine
    engine.close()


def test_memory_tags_follow_a_partial_colocation_plan(
    tiny_model_dir, monkeypatch, assert_same_samples
):
    rollout = _engine(tiny_model_dir, "split-rollout")
    genrm = _engine(tiny_model_dir, "split-genrm")
    expected = rollout.generate(_requests(), SAMPLING)
    assert rollout.memory_tags == ("weights", "kv_cache")
    calls = []
    for name, engine in (("rollout", rollout), ("genrm", genrm)):
        original = engine.wake_up
        monkeypatch.setattr(
            engine,
            "wake_up",
            lambda tags=None, name=name, original=original: (
                calls.append((name, None if tags is None else tuple(tags))),
                original(tags),
            ),
        )
    trainer = torch.nn.Linear(4, 4)
    plan = Plan.partial_colocation(
        rollout=rollout,
        genrm=genrm,
        train=TrainerRole(trainer, torch.optim.SGD(trainer.parameters(), lr=0.1)),
    )
    plan.switch_to("train")
    assert rollout.resident_bytes() == genrm.resident_bytes() == 0
    plan.switch_to("sync")
    # Weight sync needs the rollout engine's weights only: its KV cache and the GenRM sleep.
    assert calls == [("rollout", ("weights",))]
    assert not is_paused("split-rollout/weights") and is_paused("split-rollout/kv_cache")
    assert genrm.resident_bytes() == 0
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] are asleep"):
        rollout.generate(_requests(), SAMPLING)
    source = make_tiny_causal_lm(arch="qwen2", seed=0, max_position_embeddings=512)
    rollout.update_weights(source.named_parameters())  # the same weights: outputs stay
    calls.clear()
    plan.switch_to("rollout")
    # Every weight wakes before any KV cache.
    assert calls == [
        ("genrm", ("weights",)),
        ("rollout", ("kv_cache",)),
        ("genrm", ("kv_cache",)),
    ]
    assert_same_samples(rollout.generate(_requests(), SAMPLING), expected, atol=1e-5)
    assert_same_samples(genrm.generate(_requests(), SAMPLING), expected, atol=1e-5)
    plan.sleep_all()
    rollout.wake_up()  # a full wake-up after sleeping whole works too
    assert_same_samples(rollout.generate(_requests(), SAMPLING), expected, atol=1e-5)
    rollout.close()
    genrm.close()


def test_plan_load_moves_kv_slots_between_engines(tiny_model_dir):
    probe = _engine(tiny_model_dir, "split-probe")
    # total_fraction 1 and no smoothing: each engine's share is the rollout fraction (or 1 - it).
    device_bytes = _device_bytes_for(probe, 4, 0.5)
    probe.close()
    rollout = _engine(tiny_model_dir, "split-load-r", device_memory_bytes=device_bytes)
    genrm = _engine(tiny_model_dir, "split-load-g", device_memory_bytes=device_bytes)
    trainer = torch.nn.Linear(4, 4)
    # The tiny model's weights weigh about 13 slots: shares below ~0.41 hold no slot at all.
    split = MemorySplit(
        total_fraction=1.0, min_rollout_fraction=0.45, max_rollout_fraction=0.55, smoothing=0.0
    )
    plan = Plan.partial_colocation(
        rollout=rollout, genrm=genrm, train=TrainerRole(trainer), split=split
    )
    plan.switch_to("rollout")  # the engines were awake: nothing to allocate, the size applies
    rollout.generate(_requests(), SAMPLING)
    genrm.generate(_requests(), SAMPLING)
    assert rollout.num_slots == genrm.num_slots == 4
    plan.update_load(rollout_pending_tokens=900, genrm_pending_tokens=100)
    assert rollout.num_slots == genrm.num_slots == 4  # nothing re-allocated yet
    plan.switch_to("train")
    plan.switch_to("rollout")  # the KV caches wake at their new sizes
    assert rollout.num_slots > 4 > genrm.num_slots >= 1
    for engine, fraction in ((rollout, 0.55), (genrm, 0.45)):
        assert engine.num_slots == slots_for_fraction(
            fraction=fraction,
            device_total_bytes=device_bytes,
            weight_bytes=engine._weight_bytes,
            layout=engine._kv_layout,
            max_batch_size=8,
        )
    rollout.close()
    genrm.close()


def test_resident_bytes_match_the_regions(tiny_model_dir, sized_engine):
    engine = sized_engine
    engine.set_memory_fraction(1.0)
    engine.generate(_requests(), SAMPLING)
    for num_slots, fraction in ((8, 1.0), (4, 0.5)):
        engine.set_memory_fraction(fraction)
        engine.generate(_requests(), SAMPLING)
        assert engine.num_slots == num_slots
        # The sizing formula counts exactly what the region holds, so shares are honest.
        regions = resident_bytes("split-sized/weights") + resident_bytes("split-sized/kv_cache")
        assert engine.resident_bytes() == regions
    engine.sleep()
    assert engine.resident_bytes() == 0
    engine.wake_up()


def test_fraction_applies_at_the_next_allocation_not_mid_call(sized_engine, assert_same_samples):
    engine = sized_engine
    engine.set_memory_fraction(1.0)
    expected = engine.generate(_requests(), SAMPLING)
    assert engine.num_slots == 8

    async def consume():
        got, seen_slots = [], []
        async for completion in engine.stream(_requests(), SAMPLING):
            if not got:  # the call is running: the new size must wait for the next one
                engine.set_memory_fraction(0.5)
            seen_slots.append(engine.num_slots)
            got.append(completion)
        return got, seen_slots

    got, seen_slots = asyncio.run(consume())
    assert seen_slots == [8] * len(expected)
    got.sort(key=lambda c: (c.request_index, c.sample_index))
    assert_same_samples(got, expected, atol=1e-5)
    # Asleep, or with only the weights awake, nothing is allocated: the size waits.
    engine.sleep()
    engine.set_memory_fraction(1.0)
    engine.set_memory_fraction(0.5)
    engine.wake_up(tags=("weights",))
    assert engine.num_slots == 8
    engine.wake_up(tags=("kv_cache",))
    assert engine.num_slots == 4
    assert_same_samples(engine.generate(_requests(), SAMPLING), expected, atol=1e-5)


def test_fewer_slots_give_the_same_samples(sized_engine, assert_same_samples):
    engine = sized_engine
    outputs = {}
    for fraction in (1.0, 0.5, 0.45):
        engine.set_memory_fraction(fraction)
        outputs[fraction] = (engine.generate(_requests(), SAMPLING), engine.num_slots)
    slots = [num_slots for _, num_slots in outputs.values()]
    assert slots[0] == 8 and slots[1] == 4 and 1 <= slots[2] < 4, slots
    reference = outputs[1.0][0]
    for got, _ in outputs.values():
        assert_same_samples(got, reference, atol=1e-5)


def test_two_slots_equal_eight_slots(tiny_model_dir, assert_same_samples):
    probe = _engine(tiny_model_dir, "split-probe")
    device_bytes = _device_bytes_for(probe, 2, 0.3)
    probe.close()
    engine = _engine(tiny_model_dir, "split-two", device_memory_bytes=device_bytes)
    sampling = SamplingParams(n=3, temperature=1.0, top_k=20, max_new_tokens=16, seed=11)
    eight = engine.generate(_requests(), sampling)
    assert engine.num_slots == 8
    engine.set_memory_fraction(0.3)
    two = engine.generate(_requests(), sampling)
    assert engine.num_slots == 2
    assert_same_samples(two, eight, atol=1e-5)
    engine.close()


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan"), float("inf"), "half"], ids=repr)
def test_invalid_fractions_are_rejected(sized_engine, fraction):
    before = sized_engine.num_slots
    with pytest.raises(ValueError, match=r"fraction=.*\(0, 1\]"):
        sized_engine.set_memory_fraction(fraction)
    sized_engine.generate(_requests(), SamplingParams(max_new_tokens=2))
    assert sized_engine.num_slots == before


def test_a_fraction_without_room_for_one_slot_is_rejected(sized_engine):
    # The notional device holds 2x (weights + 4 slots); 1e-3 of it cannot hold the weights.
    with pytest.raises(ValueError, match=r"fraction=0\.001.*max_seq_len=64"):
        sized_engine.set_memory_fraction(1e-3)


def test_no_device_total_means_max_batch_size(tiny_model_dir):
    engine = _engine(tiny_model_dir, "split-free", max_batch_size=3)
    engine.set_memory_fraction(0.01)  # CPU without device_memory_bytes: no limit to apply
    engine.generate(_requests(), SamplingParams(max_new_tokens=2))
    assert engine.num_slots == 3
    engine.close()


def test_a_plan_refuses_two_engines_in_one_region(tiny_model_dir):
    first = _engine(tiny_model_dir, "same-prefix")
    second = _engine(tiny_model_dir, "same-prefix")
    assert first.memory_regions == ("same-prefix/weights", "same-prefix/kv_cache")
    assert first.image_processor is None  # a text model
    with pytest.raises(ValueError, match="share the memory region 'same-prefix/weights'"):
        Plan.full_colocation(rollout=first, genrm=second, train=TrainerRole(torch.nn.Linear(2, 2)))
    first.close()
    second.close()
