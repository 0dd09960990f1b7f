import pytest

from yatt.placement import MemorySplit, PendingLoad
from yatt.placement._split import next_rollout_fraction

NUM_GPUS = 0


@pytest.mark.parametrize(
    ("rollout", "genrm", "expected"),
    [
        (600, 400, 0.6),  # proportional inside the bounds
        (990, 10, 0.8),  # clipped to max
        (0, 500, 0.3),  # clipped to min
        (0, 0, 0.5),  # nothing pending: keep the current split
    ],
    ids=["proportional", "clip-max", "clip-min", "no-load"],
)
def test_target_without_smoothing(rollout, genrm, expected):
    split = MemorySplit(smoothing=0.0)
    assert next_rollout_fraction(split, 0.5, rollout, genrm) == pytest.approx(expected)


def test_smoothing_moves_part_of_the_way_and_converges():
    split = MemorySplit(smoothing=0.75)
    fraction = 0.5
    fraction = next_rollout_fraction(split, fraction, 700, 300)
    assert fraction == pytest.approx(0.75 * 0.5 + 0.25 * 0.7)
    for _ in range(60):
        fraction = next_rollout_fraction(split, fraction, 700, 300)
    assert fraction == pytest.approx(0.7, abs=1e-6)


def test_rejects_negative_load():
    with pytest.raises(ValueError, match="rollout_pending_tokens=-1"):
        next_rollout_fraction(MemorySplit(), 0.5, -1, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"total_fraction": 0.0}, "total_fraction"),
        ({"total_fraction": 1.5}, "total_fraction"),
        ({"min_rollout_fraction": 0.9}, "min_rollout_fraction"),
        ({"max_rollout_fraction": 1.2}, "max_rollout_fraction"),
        ({"initial_rollout_fraction": 0.1}, "initial_rollout_fraction"),
        ({"smoothing": 1.0}, "smoothing"),
    ],
    ids=["total-zero", "total-over-one", "min-over-max", "max-over-one", "initial-out", "smooth-1"],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MemorySplit(**kwargs)


def test_pending_load_is_the_time_weighted_mean_of_the_queues():
    # Hand-built step: 3000 rollout tokens pending for 1 s, then 1000 for 3 s while the judge
    # queue grows to 2000 tokens, then nothing for the last 1 s (end at t=15).
    load = PendingLoad()
    load.record(10.0, rollout_tokens=3000, genrm_tokens=0)
    load.record(11.0, rollout_tokens=1000, genrm_tokens=2000)
    load.record(14.0, rollout_tokens=0, genrm_tokens=0)
    means = load.pending_tokens(15.0)
    # rollout: (3000*1 + 1000*3 + 0*1) / 5 = 1200; genrm: (2000*3) / 5 = 1200
    assert means == pytest.approx(
        {"rollout_pending_tokens": 1200.0, "genrm_pending_tokens": 1200.0}
    )
    # ...so an even split of the engines' memory, as its target.
    target = next_rollout_fraction(MemorySplit(smoothing=0.0), 0.7, **means)
    assert target == pytest.approx(0.5)


def test_pending_load_without_time_keeps_the_split():
    load = PendingLoad()
    assert load.pending_tokens(1.0) == {"rollout_pending_tokens": 0.0, "genrm_pending_tokens": 0.0}
    load.record(1.0, rollout_tokens=5, genrm_tokens=5)
    means = load.pending_tokens(1.0)  # no time passed
    assert next_rollout_fraction(MemorySplit(), 0.4, **means) == 0.4


def test_pending_load_refuses_negative_tokens_and_time_going_back():
    load = PendingLoad()
    with pytest.raises(ValueError, match="genrm_tokens=-2"):
        load.record(0.0, rollout_tokens=1, genrm_tokens=-2)
    load.record(2.0, rollout_tokens=1, genrm_tokens=1)
    with pytest.raises(ValueError, match="before the last"):
        load.record(1.0, rollout_tokens=1, genrm_tokens=1)
