"""reduce_turn_metrics over two gloo ranks whose multi-turn counts differ (a cause only one
rank saw): counts summed, turns_max the max, turns_mean the summed turns over the summed
trajectories (not the mean of the ranks' means)."""

NUM_GPUS = 0


from yatt.testing import run_rank_script

_WORKER = """
    import json
    import torch.distributed as dist
    from yatt.core import reduce_turn_metrics

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # rank 0: 3 trajectories of 1, 2 and 3 turns; rank 1: one of 5 turns, a tool timeout
    per_rank = [
        ({"m/num_trajectories": 3.0, "m/turns_mean": 2.0, "m/turns_max": 3.0,
          "m/end/stop": 3.0}, 6),
        ({"m/num_trajectories": 1.0, "m/turns_mean": 5.0, "m/turns_max": 5.0,
          "m/end/length": 1.0, "m/tool_errors/timeout": 1.0}, 5),
    ]
    metrics, num_turns = per_rank[rank]
    total = reduce_turn_metrics(metrics, num_turns=num_turns, prefix="m/")
    print("RESULT " + json.dumps(total), flush=True)
    dist.destroy_process_group()
    """


def test_two_ranks_sum_their_counts_and_weigh_turns_by_trajectory(tmp_path):
    results = run_rank_script(_WORKER, 2, tmp_path)
    expected = {
        "m/num_trajectories": 4.0,
        "m/turns_mean": 11 / 4,  # (1 + 2 + 3 + 5) / 4; the ranks' means would give 3.5
        "m/turns_max": 5.0,
        "m/end/stop": 3.0,
        "m/end/length": 1.0,
        "m/tool_errors/timeout": 1.0,
    }
    for result in results:
        assert result == expected


def test_one_process_gives_its_own_values():
    from yatt.core import reduce_turn_metrics

    metrics = {"multiturn/num_trajectories": 2.0, "multiturn/turns_mean": 1.5}
    metrics["multiturn/turns_max"] = 2.0
    total = reduce_turn_metrics(metrics, num_turns=3)
    assert total == metrics
