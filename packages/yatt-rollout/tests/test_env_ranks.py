"""Each data-parallel rank runs its own environments (the per-rank controller): two gloo ranks
roll out their own shards of rows, their tools in worker processes of their own, and only the
step's counts cross ranks."""

NUM_GPUS = 0

import textwrap

from yatt.testing import run_rank_script

ENV_FILE = '''
import os


class Where:
    def reset(self, **row):
        self.value = row["value"]

    def locate(self) -> str:
        """Which process runs this call, and its parent."""
        return f"{os.getpid()} {os.getppid()}"

    def get_reward(self) -> float:
        return float(self.value)
'''

RANK_SCRIPT = """
import asyncio, json, os, re, sys
import torch.distributed as dist
from yatt.rollout import SamplingParams
from yatt.rollout.env import EnvConfig, MultiTurnRollout, PoolToolRunner
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rows = [{"prompt": "where?", "value": i} for i in range(6)][rank::world]  # this rank's shard
tokenizer = make_tokenizer()
tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
call = '<tool_call>{"name": "locate", "arguments": {}}</tool_call>'
engine = ScriptedEngine(
    tokenizer=tokenizer, respond=lambda text: "ok" if "<|im_start|>tool" in text else call
)
config = EnvConfig(environment=(sys.argv[1] + ":Where",), tool_timeout_s=30.0)
runner = PoolToolRunner.from_timeout(config.tool_timeout_s, num_workers=1)
try:
    rollout = MultiTurnRollout(engine, config, runner=runner)
    trajectories, stats = asyncio.run(rollout.run(rows, SamplingParams(n=2)))
finally:
    runner.pool.close()
located = [m["content"] for t in trajectories for m in t.messages if m["role"] == "tool"]
counts = [None] * world
dist.all_gather_object(counts, stats.as_metrics())  # only counts cross ranks
print("RESULT", json.dumps({
    "rank": rank, "pid": os.getpid(),
    "rewards": [t.env_reward for t in trajectories],
    "located": located,
    "total_calls": sum(c["multiturn/num_tool_calls"] for c in counts),
}))
dist.destroy_process_group()
"""


def test_each_rank_runs_its_own_environments(tmp_path):
    env_file = tmp_path / "where.py"
    env_file.write_text(textwrap.dedent(ENV_FILE))
    results = run_rank_script(RANK_SCRIPT, 2, tmp_path, args=[str(env_file)], timeout_s=300)
    assert [r["rank"] for r in results] == [0, 1]
    # Rank r's rows are r, r + 2, r + 4 (two samples each); the rewards are the rows' values.
    assert [r["rewards"] for r in results] == [[0, 0, 2, 2, 4, 4], [1, 1, 3, 3, 5, 5]]
    for result in results:
        workers = {tuple(map(int, text.split())) for text in result["located"]}
        # Every call ran in a worker process whose parent is this rank, not another process.
        assert len(result["located"]) == 6
        assert all(parent == result["pid"] and pid != result["pid"] for pid, parent in workers)
        assert result["total_calls"] == 12
