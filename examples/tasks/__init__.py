"""The embedded tasks that empty config paths point at, built on this machine (no downloads):

    text    tiny_task.py          single-digit addition: a tiny policy and a tiny generative
                                  judge fitted on the run's own judge template
    vision  tiny_vision_task.py   count the dots in 32 x 32 pictures: a tiny Qwen2-VL policy,
                                  the exact-match rule as the reward
    tools   tools_task.py         guess a number 0-7 with a `guess` tool (multi-turn): a tiny
                                  policy fitted to the tool-call format, the environment's
                                  get_reward() as the reward

    paths = build_task("text", out_dir / "embedded", cfg.reward.template)

grpo_config.EMBEDDED_TASKS says what the config knows of each (its folder under out_dir, its
rows' columns and image field, its config defaults); grpo_preflight builds the one `task`
names, only when an empty path asks for it. The tasks fit their tiny models with yatt-testing's
builders: that package is imported here only, when a task is built.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from yatt import genrm

logger = logging.getLogger("train_grpo")
MODULES = {
    "text": "tasks.tiny_task",
    "vision": "tasks.tiny_vision_task",
    "tools": "tasks.tools_task",
}


def build_task(name: str, workdir: Path, template: genrm.JudgeTemplate) -> dict[str, Path]:
    """The task's files under `workdir` (prompts, eval, policy, and judge where it has one):
    built once, under a file lock every rank waits on, then reused."""
    module = importlib.import_module(MODULES[name])
    if not module.is_prepared(workdir):
        logger.info(
            "building the embedded %s task once under %s: its tiny models fitted on this CPU "
            "(about 1 min); later runs with this out_dir reuse them",
            name,
            workdir,
        )
    return module.prepare_locked(workdir, template)
