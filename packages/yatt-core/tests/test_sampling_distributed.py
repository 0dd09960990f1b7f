"""DynamicSampler on two gloo ranks that fill at different times: they agree on when the step
ends (rounds), abort together (stream), and raise together on an unfilled batch. Every rank runs
this file as a script (one launch, the scenarios in turn); the tests assert on what each rank
wrote. Expected draws are worked out by hand: draw = ceil(missing / max(keep rate over all
ranks so far, 1 / max_oversample)), the initial factor before any keep rate."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

NUM_GPUS = 0

VARIED, FLAT = [0.0, 1.0], [1.0, 1.0]


# -- what each rank runs ---------------------------------------------------------------------


def _groups(rewards_per_group):
    from yatt.core import rollout_batch

    rows = [
        {
            "input_ids": [1, 2],
            "loss_mask": [0, 1],
            "rollout_logprobs": [0.0, -0.5],
            "group_id": g,
            "reward": r,
        }
        for g, rewards in enumerate(rewards_per_group)
        for r in rewards
    ]
    return rollout_batch(rows)  # of no rows too: what a full rank offers


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _poll_abort(sampler, timeout_s: float = 60.0) -> int:
    """Poll should_abort() until True; how many polls said False first."""
    deadline, num_false = time.monotonic() + timeout_s, 0
    while not sampler.should_abort():
        if time.monotonic() > deadline:
            raise TimeoutError("should_abort() never became True")
        num_false += 1
        time.sleep(0.01)
    return num_false


def scenario_rounds(rank: int, group, out: dict) -> None:
    """Rank 0 fills in round 1, rank 1 in round 3; both run 3 rounds."""
    from yatt.core import DynamicSampler

    sampler = DynamicSampler(
        target_groups=2, oversample=1.0, max_oversample=4.0, max_rounds=3, group=group
    )
    offered = {
        0: [[VARIED, VARIED]],
        1: [[FLAT, FLAT], [VARIED, FLAT, FLAT, FLAT], [VARIED, FLAT, FLAT]],
    }[rank]
    draws, decisions = [], []
    while not sampler.is_done():
        num = sampler.num_to_draw()
        draws.append(num)
        round_index = len(draws) - 1
        sampler.add(_groups(offered[round_index]) if num else _groups([]))
        decisions.append(sampler.is_done())
    batch, stats = sampler.take()
    out["rounds"] = {
        "draws": draws,
        "decisions": decisions,
        "stats": stats,
        "num_samples": len(batch),
        "last_keep_rate": sampler.last_keep_rate,
    }


def scenario_rounds_unfilled_error(rank: int, group, out: dict) -> None:
    """Rank 0 fills at once, rank 1 never: both ranks raise, with the same message."""
    from yatt.core import DynamicSampler, UnfilledBatchError

    sampler = DynamicSampler(target_groups=1, max_rounds=2, on_unfilled="error", group=group)
    draws = []
    while not sampler.is_done():
        num = sampler.num_to_draw()
        draws.append(num)
        sampler.add(_groups([VARIED if rank == 0 else FLAT] * num))
    try:
        sampler.take()
        out["unfilled_error"] = {"draws": draws, "error": None}
    except UnfilledBatchError as err:
        out["unfilled_error"] = {"draws": draws, "error": str(err)}


def scenario_stream(rank: int, group, out: dict, flags: Path) -> None:
    """Rank 0 is full first and must not abort until rank 1 is full too."""
    from yatt.core import DynamicSampler

    sampler = DynamicSampler(
        target_groups=1, oversample=1.0, max_oversample=4.0, mode="stream", group=group
    )
    record: dict = {"draws": [sampler.num_to_draw()]}
    if rank == 0:
        sampler.add(_groups([VARIED]))
        record["abort_when_alone_full"] = sampler.should_abort()
        (flags / "rank0-full").touch()
        record["num_polls_false"] = _poll_abort(sampler)
        sampler.record_aborted(0)
    else:
        sampler.add(_groups([FLAT]))
        record["abort_before_full"] = sampler.should_abort()
        # keep rate (0 + 1 x prior 1) / (1 + 1) = 1/2: factor 2
        record["draws"].append(sampler.num_to_draw(in_flight=0))
        _wait_for(flags / "rank0-full")
        sampler.add(_groups([VARIED]))  # the first of the 2 in flight to be judged
        _poll_abort(sampler)
        sampler.record_aborted(1)  # the other one cut
    _, stats = sampler.take()
    record["stats"] = stats
    out["stream"] = record


def scenario_stream_gives_up(rank: int, group, out: dict) -> None:
    """Rank 1 spends its draw budget without filling; rank 0 (full) aborts once rank 1 is
    done; the unfilled batch trains."""
    from yatt.core import DynamicSampler

    sampler = DynamicSampler(
        target_groups=1, should_adapt=False, max_rounds=1, mode="stream", group=group
    )
    record: dict = {"draws": [sampler.num_to_draw()]}
    if rank == 0:
        sampler.add(_groups([VARIED]))
        _poll_abort(sampler)
    else:
        sampler.add(_groups([FLAT]))
        record["draws"].append(sampler.num_to_draw(in_flight=0))  # the budget (1) is spent
        record["abort_when_not_full"] = sampler.should_abort()
    _, stats = sampler.take()  # rank 1 signals here that it is done
    record["stats"] = stats
    out["stream_gives_up"] = record


def main() -> None:
    import torch.distributed as dist

    from yatt.core import init_runtime

    out_dir = Path(sys.argv[1])
    out: dict = {}
    with init_runtime(seed=0) as rt:
        scenario_rounds(rt.dp_rank, rt.dp_group, out)
        scenario_rounds_unfilled_error(rt.dp_rank, rt.dp_group, out)
        scenario_stream(rt.dp_rank, rt.dp_group, out, out_dir)
        scenario_stream_gives_up(rt.dp_rank, rt.dp_group, out)
        dist.barrier()
        (out_dir / f"rank{rt.rank}.json").write_text(json.dumps(out))


# -- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from yatt.testing import run_ranks

    out_dir = tmp_path_factory.mktemp("sampler")
    run_ranks(
        [sys.executable, __file__, str(out_dir)],
        2,
        env={"CUDA_VISIBLE_DEVICES": ""},
        timeout_s=180,
    )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_rounds_stop_together_when_the_last_rank_fills(ranks):
    first, second = ranks[0]["rounds"], ranks[1]["rounds"]
    # Round 2: keep rate 2/4 over both ranks -> 2 missing x 2; round 3: 3/8 -> ceil(1 x 8/3).
    assert first["draws"] == [2, 0, 0]
    assert second["draws"] == [2, 4, 3]
    assert first["decisions"] == second["decisions"] == [False, False, True]
    for out in (first, second):
        assert out["stats"]["is_filled"] == 1.0 and out["stats"]["is_filled_all_ranks"] == 1.0
        assert out["num_samples"] == 4
        assert out["last_keep_rate"] == pytest.approx(4 / 11)  # (2 + 2) kept of (2 + 9)
    assert second["stats"]["num_groups_generated"] == 9 and second["stats"]["num_rounds"] == 3
    assert second["stats"]["keep_rate"] == pytest.approx(2 / 9)


@pytest.mark.slow
def test_an_unfilled_batch_raises_on_every_rank_naming_the_keep_rate(ranks):
    first, second = ranks[0]["unfilled_error"], ranks[1]["unfilled_error"]
    assert first["draws"] == [1, 0]
    assert second["draws"] == [1, 2]  # round 2: keep rate 1 of 2 over both ranks -> factor 2
    for out in (first, second):  # both raise; each names its own counts and the shared rate
        assert "1 of 2 ranks filled" in out["error"]
        assert "keep rate over all ranks 0.250 (1 of 4 groups" in out["error"]
    assert "this rank kept 1 of 1 groups after 2 rounds (1 judged)" in first["error"]
    assert "this rank kept 0 of 1 groups after 2 rounds (3 judged)" in second["error"]


@pytest.mark.slow
def test_stream_aborts_only_once_every_rank_is_full(ranks):
    first, second = ranks[0]["stream"], ranks[1]["stream"]
    assert first["abort_when_alone_full"] is False
    assert second["abort_before_full"] is False
    # 1 missing / ((0 kept + 1 x prior 1) / (1 judged + 1)): the prior is 1 / oversample
    assert second["draws"] == [1, 2]
    for out in (first, second):
        assert out["stats"]["is_filled_all_ranks"] == 1.0
    assert second["stats"]["num_groups_aborted"] == 1
    assert second["stats"]["num_groups_drawn"] == 3 and second["stats"]["num_rounds"] == 2


@pytest.mark.slow
def test_stream_of_a_rank_that_gives_up_releases_the_others(ranks):
    first, second = ranks[0]["stream_gives_up"], ranks[1]["stream_gives_up"]
    assert second["draws"] == [1, 0] and second["abort_when_not_full"] is False
    assert first["stats"]["is_filled"] == 1.0 and second["stats"]["is_filled"] == 0.0
    assert first["stats"]["is_filled_all_ranks"] == second["stats"]["is_filled_all_ranks"] == 0.0


if __name__ == "__main__":
    main()
