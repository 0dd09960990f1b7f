"""take_step_batch (the step's batch, a stop signal raised on every rank as StepStopped) and
draw_prompts (unusable draws redrawn; a whole epoch of them is an error naming the counts)."""

NUM_GPUS = 0

import pytest

from yatt import core


def _groups(rewards_by_group: list[list[float]]) -> core.Batch:
    rows = [
        {"input_ids": [1], "group_id": g, "reward": r, "task_reward": r}
        for g, rewards in enumerate(rewards_by_group)
        for r in rewards
    ]
    return core.Batch.from_samples(rows)


def _sampler() -> core.DynamicSampler:
    return core.DynamicSampler(target_groups=1, reward_key="task_reward")


def test_the_step_batch_drops_the_keep_signal_and_keeps_the_trained_reward():
    sampler = _sampler()
    sampler.num_to_draw()
    sampler.add(_groups([[0.0, 1.0]]))
    assert sampler.is_done()
    batch, stats = core.take_step_batch(sampler, should_stop=False, drop_keys=("task_reward",))
    assert "task_reward" not in batch.samples and batch.samples["reward"].tolist() == [0.0, 1.0]
    assert not stats.get("is_stopped")


def test_a_stop_signal_ends_the_step_as_step_stopped_with_its_stats():
    sampler = _sampler()
    sampler.num_to_draw()
    sampler.add(_groups([[1.0, 1.0]]))  # no variance: not full
    with pytest.raises(core.StepStopped) as raised:
        core.take_step_batch(sampler, should_stop=True)
    assert raised.value.sampling_stats["is_stopped"] == 1


class _Loader:
    rank, num_local_rows = 0, 4

    def __init__(self) -> None:
        self.num_calls = 0

    def next_batch(self, num_rows):
        self.num_calls += 1
        return [{"prompt": f"r{self.num_calls}"}] * num_rows


class _Encoder:
    """Usable rows only from the `usable_from`-th draw on."""

    def __init__(self, loader: _Loader, usable_from: int) -> None:
        self.loader, self.usable_from = loader, usable_from

    def encode(self, rows):
        if self.loader.num_calls < self.usable_from:
            return []
        return [core.Prompt(row, [1]) for row in rows]

    def skipped_by_cause(self, loader):
        return {"bad_prompt": 2 * loader.num_calls}


def test_draw_prompts_draws_again_after_a_draw_of_unusable_rows():
    loader = _Loader()
    prompts = core.draw_prompts(loader, _Encoder(loader, usable_from=3), 2)
    assert [p.row["prompt"] for p in prompts] == ["r3", "r3"] and loader.num_calls == 3


def test_draw_prompts_stops_after_a_whole_epoch_without_a_usable_prompt():
    loader = _Loader()
    with pytest.raises(
        ValueError, match=r"data\.path: the last 8 rows rank 0 drew .*'bad_prompt': 8"
    ):
        core.draw_prompts(loader, _Encoder(loader, usable_from=99), 2)
