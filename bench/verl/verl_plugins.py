"""verl-side pieces of bench/verl/verl_step.py, loaded inside verl's Ray workers (never by yatt).

Two classes plug bench/step/step.py's workload into verl 0.9.1 without touching verl's code paths
that are timed:

ForcedLengthAgentLoop: verl's single-turn agent loop with each request's `max_tokens` set to
  its forced length and `ignore_eos=True` (vLLM's own per-request sampling parameters, the way
  yatt's engines force lengths: no logits processor, no early stop check of ours in the
  decode loop). verl repeats each prompt `rollout.n` times, interleaved, and hands the agent
  loop the dataset row; the row carries the group's forced lengths (prompt-major, group-minor,
  from _step_setup.response_lengths). verl's V1 trainer (its default) numbers a prompt's copies
  (session_id 0..n-1): copy k takes length k. The V0 trainer gives no number: the k-th copy of
  row `index` that this worker process sees takes the k-th length. Which copy gets which length
  does not matter (every verdict and reward is the same); each group's set of lengths does, so
  under V0 a prompt's copies must land in one agent-loop worker: verl splits the batch into
  contiguous chunks per worker, and verl_step.py sets agent.num_workers to a divisor of the
  prompt count.

JudgeRewardManager: the reward loop's manager with the GenRM judge served by verl's reward
  model server (vLLM, colocated: woken after the rollout, slept after the reward phase). Each
  sample's judge prompt is rendered as yatt's GenRM renders it (_step_setup.JUDGE_USER in the
  judge tokenizer's chat template, the response shown one letter per token), posted as token ids
  to the reward router's /v1/completions with max_tokens = min_tokens = the forced verdict
  length (YATT_JUDGE_TOKENS, set in the Ray actors' environment by verl_step.py), ignore_eos
  and greedy decoding. Random-weight verdicts never parse: reward 0, as in yatt.

QuickPollReplayBuffer: verl's V1 sync replay buffer, unchanged but for how often it looks for
  finished rollouts: verl 0.9.1 polls every 2.0 s (a constructor default its trainer does not
  expose), so its `gen` phase ends on a 2 s tick (2.04 or 4.05 s in every step of the first
  fused-head run). Plugged through verl's documented trainer.v1.sampler.custom_sampler hook,
  with the interval from trainer.v1.sampler.sampler_kwargs.poll_interval_s (verl_step.py
  --poll-interval-s). verl's trainer gives a custom sampler none of its DAPO arguments, which
  this bench does not use (no group filtering).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_workload import forced_length, judge_prompt_ids, prompt_text  # bench/: no package

# Copies of each dataset row seen by this agent-loop worker process.
_copies_seen: dict[int, int] = {}


class ForcedLengthAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Any:
        length = forced_length(kwargs["extra_info"], _copies_seen, kwargs.get("session_id"))
        params = dict(sampling_params, max_tokens=length, ignore_eos=True)
        return await super().run(params, **kwargs)


class JudgeRewardManager(RewardManagerBase):
    def __init__(
        self,
        config,
        tokenizer,
        compute_score,
        reward_router_address: str | None = None,
        reward_model_tokenizer=None,
    ):
        super().__init__(config, tokenizer, compute_score)
        if reward_router_address is None or reward_model_tokenizer is None:
            raise ValueError(
                "JudgeRewardManager needs the reward model server: set "
                "reward.reward_model.enable=True and reward.reward_model.model_path"
            )
        self.router = reward_router_address
        self.judge_tokenizer = reward_model_tokenizer
        self.model_name = config.reward.reward_model.model_path
        # verl's V1 trainer hands the reward loop prompts, responses and raw_prompt only (no
        # dataset fields): the verdict length comes through the Ray actors' environment.
        if "YATT_JUDGE_TOKENS" not in os.environ:
            raise ValueError(
                "JudgeRewardManager: YATT_JUDGE_TOKENS (the forced verdict length) unset"
            )
        self.judge_tokens = int(os.environ["YATT_JUDGE_TOKENS"])

    async def run_single(self, data) -> dict:
        item = data[-1:][0]
        responses = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-responses.shape[-1] :].sum())
        prompt = prompt_text(item.non_tensor_batch["raw_prompt"])
        ids = judge_prompt_ids(self.judge_tokenizer, prompt, responses[:valid].tolist())
        verdict_tokens = self.judge_tokens
        payload = {
            "model": self.model_name,
            "prompt": ids,
            "max_tokens": verdict_tokens,
            "min_tokens": verdict_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        url = f"http://{self.router}/v1/completions"
        timeout = aiohttp.ClientTimeout(total=None)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=payload) as r,
        ):
            r.raise_for_status()
            out = await r.json()
        usage = out.get("usage") or {}
        return {
            "reward_score": 0.0,  # random weights never write Yes/No: yatt's default_reward
            "reward_extra_info": {
                "judge_prompt_tokens": len(ids),
                "judge_tokens": int(usage.get("completion_tokens", -1)),
                "response_tokens": valid,
            },
        }


def compute_score(**kwargs) -> float:
    """verl routes samples to the manager's run_single only when a custom reward function is
    set (else it takes the reward model for a classifier): this one is named, never called."""
    raise RuntimeError("JudgeRewardManager.run_single scores every sample")


class QuickPollReplayBuffer(ReplayBuffer):
    def __init__(self, *args, sampler_kwargs, **kwargs):
        poll_interval_s = float(sampler_kwargs.get("poll_interval_s", 2.0))
        super().__init__(
            *args, sampler_kwargs=sampler_kwargs, poll_interval=poll_interval_s, **kwargs
        )
