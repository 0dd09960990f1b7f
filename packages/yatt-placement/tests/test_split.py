import pytest

from yatt.placement import MemorySplit
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
