"""Issue 45, item 4: a self-judging GenRM on one resident base. reward.judge_dir=policy runs
the judge on the policy's built-in engine with the LoRA adapter off (rollout.engine.lora_mode=
beside): bad combinations are refused before any model loads, and a LoRA run with it trains,
in both placements (the one engine is placed once; no judge role of its own)."""

NUM_GPUS = 0

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import grpo_config
import grpo_preflight

SELF_JUDGE = ("reward.judge_dir=policy", "policy.lora.rank=8", "rollout.engine.lora_mode=beside")
# examples/train_grpo.py builds its judge and plan through grpo_setup's make_judge_engine and
# make_plan: with reward.judge_dir=policy one engine serves the policy and, adapter off, the judge.


def _read_config(tmp_path: Path, *overrides: str) -> grpo_config.TrainConfig:
    cfg, _ = grpo_config.read_config([f"out_dir={tmp_path}", *overrides])
    return cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("policy.lora=null",), r"reward.judge_dir='policy' with policy.lora=null.*frozen copy"),
        (("rollout.engine.lora_mode=merge",), r"rollout.engine.lora_mode='merge'.*=beside"),
        (("rollout.backend=vllm",), r"rollout.backend='vllm'"),
        (("rollout.max_staleness=1",), r"rollout.max_staleness=1: off-policy.*self-judge"),
    ],
    ids=["full-fine-tuning", "merge", "vllm", "off-policy"],
)
def test_bad_self_judge_combinations_are_refused_before_anything_loads(
    tmp_path, overrides, message
):
    cfg = _read_config(tmp_path, *SELF_JUDGE, *overrides)
    with pytest.raises(ValueError, match=message):
        grpo_preflight.check_self_judge(cfg)


def test_a_self_judge_needs_the_builtin_judge_backend(tmp_path):
    with pytest.raises(ValueError, match=r"reward.judge_dir='policy'.*reward.backend='sglang'"):
        _read_config(tmp_path, *SELF_JUDGE, "reward.backend=sglang")


def test_a_good_self_judge_config_passes_and_others_are_untouched(tmp_path):
    grpo_preflight.check_self_judge(_read_config(tmp_path, *SELF_JUDGE))
    grpo_preflight.check_self_judge(_read_config(tmp_path, "policy.lora.rank=8"))


@pytest.fixture(scope="module")
def embedded(embedded_task) -> list[str]:
    """The embedded task (built once per session, conftest.py); runs point at it."""
    paths = embedded_task
    return ["task=text", f"policy.model_dir={paths['policy']}", f"data.path={paths['prompts']}"]


@pytest.mark.parametrize(
    "placement",
    [("placement=full",), ("placement=partial", "rollout.sampling_mode=stream")],
    ids=["full", "partial-stream"],
)
def test_a_lora_run_judges_itself_on_its_own_engine(tmp_path, embedded, trainer, placement):
    # The tiny policy writes no yes/no verdicts: a parser that reads any text (none -> 0) and
    # the exact-match rule give the rewards their variance.
    parser = tmp_path / "any_text.py"
    parser.write_text(
        "class AnyText:\n    def parse(self, text):\n        return float(bool(text.strip()))\n"
    )
    out = tmp_path / "run"
    args = [
        *embedded,
        *SELF_JUDGE,
        *placement,
        f"reward.verdict_parser={parser}:AnyText",
        "reward.rule_weight=1.0",
        "num_steps=2",
        "data.prompts_per_rank=4",
    ]
    trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={out}", *args],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        timeout=600,
    )
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["genrm/verdicts"] > 0 and r["genrm/errors"] == 0 for r in records)
    # The policy's rows read base + adapter beside the GEMMs: the trainer's logprobs.
    assert all(r["train/rollout_mismatch"] < 1e-4 for r in records)
    # One engine placed: no judge role (no placement/<phase>/role/genrm metrics).
    assert not any("role/genrm" in key for key in records[0])


# Before session 20's fix, a LoRA resume synced policy.named_weights() (the base
# with the adapter merged in) into the engine as its new base, and the next adapter-only sync
# applied the adapter a second time (train/rollout_mismatch 0.36 on the step after).


def test_a_lora_resume_serves_the_adapter_once(tmp_path, embedded, trainer):
    out = tmp_path / "run"
    args = [*embedded, "policy.lora.rank=8", "policy.lr=2e-2", "ckpt.every_steps=1"]
    args += ["data.prompts_per_rank=4", "reward.backend=none", "reward.rule_weight=1.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, str(TRAINER), f"out_dir={out}", *args]
    trainer.run([*base, "num_steps=2"], check=True, env=env, timeout=600)
    trainer.run([*base[:2], "--resume", *base[2:], "num_steps=4"], check=True, env=env, timeout=600)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # The engine serves base + adapter, once, on every step (the ones after the resume's sync
    # and the next adapter-only sync included): the trainer's logprobs to float32 rounding.
    assert all(r["train/rollout_mismatch"] < 1e-4 for r in records)


@pytest.mark.parametrize(
    ("mode", "trainer_device", "is_bound"),
    [("beside", "cpu", True), ("merge", "cpu", False), ("beside", "cuda:1", False)],
    ids=["beside", "merge", "beside-other-device"],
)
def test_the_step_sync_binds_the_adapter_only_where_the_engine_can_read_it(
    tmp_path, mode, trainer_device, is_bound
):
    """grpo_setup.WeightSync: under LoRA with the built-in engine's lora_mode=beside on the
    trainer's device, the first sync binds the adapter's parameters and later ones refresh
    them (issue 45's sync bar); with a merged adapter or an engine on another device every
    sync goes through update_weights. Each way, after the parameters move in place the engine
    serves exactly what an engine synced with update_weights serves."""
    import grpo_setup
    import torch

    from yatt import core, rollout
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "tiny"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0)
    policy = core.TorchPolicy(
        core.TorchPolicyConfig(
            model_dir=str(model_dir),
            dtype="float32",
            parallel="none",
            lora=core.LoraConfig(rank=4, alpha=8),
        )
    )
    engines = [
        rollout.BuiltinEngine(
            model_dir,
            config=rollout.EngineConfig(
                max_batch_size=2, max_seq_len=64, region_prefix=f"ws-{mode}-{i}", lora_mode=mode
            ),
        )
        for i in range(2)
    ]
    sync = grpo_setup.WeightSync(
        engines[0], policy, is_lora=True, engine_device="cpu", trainer_device=trainer_device
    )
    requests = [rollout.Request(prompt_ids=[5, 9, 13, 2]), rollout.Request(prompt_ids=[7, 3])]
    sampling = rollout.SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    gen = torch.Generator().manual_seed(0)
    served = []
    for _ in range(2):
        with torch.no_grad():  # an optimizer step: the adapter's parameters change in place
            for param in policy.module.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=gen) * 0.05)
        sync()
        engines[1].update_weights(policy.named_adapter_weights())
        got, want = (e.generate(requests, sampling) for e in engines)
        assert [c.logprobs for c in got] == [c.logprobs for c in want]
        served.append([c.logprobs for c in got])
    assert sync.is_bound == is_bound
    assert served[0] != served[1]
    for engine in engines:
        engine.close()
