"""The rebalance plan, without processes: placement of parts and picklability."""

NUM_GPUS = 0

import pickle

import numpy as np

from yatt.balance import imbalance
from yatt.balance._dist_plan import make_plan


def plan_for(costs_by_rank, groups_by_rank=None, equal_size=False):
    costs = [np.asarray(c, dtype=float) for c in costs_by_rank]
    return make_plan(
        rank=0,
        costs=costs,
        volumes=costs,
        group_labels=groups_by_rank or [None] * len(costs),
        equal_size=equal_size,
    )


def test_balanced_input_moves_nothing():
    # {5, 3}, {7, 1}, {6, 2} is the only split into three parts of 8: the plan must find it
    # and leave every part where it already is.
    plan = plan_for([[5, 3], [7, 1], [6, 2]])
    origin = np.repeat(np.arange(3), plan.counts)
    np.testing.assert_array_equal(plan.destination, origin)


def test_each_part_goes_where_most_of_its_volume_is():
    # Rank 0 holds everything; the part it keeps must be the heavier-volume one it already has.
    plan = plan_for([[10, 9, 1, 1, 1], []])
    assert imbalance([plan.held_by(0), plan.held_by(1)], [10, 9, 1, 1, 1]) < 1.1
    assert plan.destination[0] == 0  # the largest sample stays home


def test_group_labels_are_local_to_a_rank():
    # Same label 0 on both ranks: two different groups, free to land on different ranks.
    plan = plan_for([[5, 5], [5, 5]], groups_by_rank=[np.array([0, 0]), np.array([0, 0])])
    assert plan.destination[0] == plan.destination[1]
    assert plan.destination[2] == plan.destination[3]
    assert plan.destination[0] != plan.destination[2]


def test_plan_is_small_and_picklable():
    plan = plan_for([np.ones(1000), np.ones(500)])
    again = pickle.loads(pickle.dumps(plan))
    np.testing.assert_array_equal(again.destination, plan.destination)
    assert again.counts == (1000, 500) and len(pickle.dumps(plan)) < 20_000
