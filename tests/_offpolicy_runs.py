"""What the off-policy crash tests share (test_train_grpo_offpolicy.py, and
test_train_grpo_offpolicy_tools.py on the multi-turn task): an AsyncRollout that records what
the trainer took, an in-process run of the trainer, and the loader's own sequence of rows."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import grpo_config
import grpo_preflight
import train_grpo
from grpo_setup import save_config

from yatt import core

RUN_DEADLINE_S = 120.0  # a run of the crash test takes about 10 s


class RecordingRollout(core.AsyncRollout):
    """core.AsyncRollout that notes the rows the trainer took, where each step ended, and the
    prompts a resume re-queued."""

    instances: ClassVar[list] = []

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.taken: list[int] = []
        self.taken_before_version: dict[int, int] = {}
        self.requeued: list[int] = []
        self.deadline = time.monotonic() + RUN_DEADLINE_S
        RecordingRollout.instances.append(self)

    def take(self, num_prompts, **kwargs):
        # a prompt left in flight and never generated again would make the run wait forever
        assert time.monotonic() < self.deadline, "the run outlived its deadline: a lost prompt?"
        prompts = super().take(num_prompts, **kwargs)
        self.taken.extend(p.row_index for p in prompts)
        return prompts

    def set_version(self, version: int) -> None:
        self.taken_before_version[version] = len(self.taken)
        super().set_version(version)

    def start(self) -> None:
        self.requeued = [p.row_index for p in self._in_flight.unfinished()]
        super().start()

    def rows_in_flight(self) -> list[int]:
        return [p["row_index"] for p in self.state_dict()["in_flight"]["prompts"]]


def resume_paused_region_tags() -> None:
    """Region tags are per process, and an engine closed asleep leaves its tags paused: an
    earlier test file's engine of the default prefix did, and this file's in-process runs then
    could not allocate under 'rollout/kv_cache' (CI, session 20). Start from none paused."""
    from yatt.placement import is_paused, region_tags, resume

    paused = [tag for tag in region_tags() if is_paused(tag)]
    if paused:
        resume(*paused)


def train_in_process(*overrides: str, should_resume: bool = False) -> int:
    resume_paused_region_tags()
    args = train_grpo.parse_args([*overrides, *(["--resume"] if should_resume else [])])
    cfg = grpo_preflight.preflight(grpo_config.config_from_args(args), should_resume=should_resume)
    save_config(cfg)  # as main() does: what --resume reads
    runtime = core.init_runtime(seed=cfg.seed, tp_size=1)
    try:
        return train_grpo.train(cfg, runtime, should_resume=should_resume)
    finally:
        runtime.shutdown()


def loader_rows(cfg: grpo_config.TrainConfig, num_rows: int) -> list[int]:
    """The first `num_rows` rows a fresh loader of this run gives, across epochs."""
    loader = core.ShardedLoader(
        cfg.data.path, batch_size=cfg.data.prompts_per_rank, rank=0, world_size=1,
        prompt_key=cfg.data.prompt_key, seed=cfg.seed,
    )  # fmt: skip
    return [row[core.ROW_INDEX_KEY] for _ in range(num_rows) for row in loader.next_batch(1)]
