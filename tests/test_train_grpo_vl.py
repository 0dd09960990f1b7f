"""The reference trainer on the embedded image task (task=vision): a tiny Qwen2-VL counting dots,
images through the loader, the rollout, the train step and the eval; bad image rows are counted
skips, and a policy that takes no images is refused before any model loads."""

NUM_GPUS = 0

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import grpo_config
import grpo_preflight
from tasks import tiny_vision_task

from yatt.testing import make_tiny_causal_lm


@pytest.fixture(scope="module")
def vision(tmp_path_factory) -> Path:
    """The embedded image task built once (pictures and the fitted policy)."""
    workdir = tmp_path_factory.mktemp("vision") / "embedded-vision"
    tiny_vision_task.prepare(workdir, None)
    return workdir


def _run(trainer, out: Path, vision: Path, *args: str) -> subprocess.CompletedProcess:
    """One run of the trainer, forked from the session's preloaded one (tests/conftest.py)."""
    command = [
        sys.executable,
        str(TRAINER),
        "task=vision",
        f"out_dir={out}",
        f"policy.model_dir={vision / 'policy'}",
        "data.prompts_per_rank=4",
        "rollout.samples_per_prompt=4",
        *args,
    ]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return trainer.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_image_task_trains_with_images_and_evaluates(tmp_path, vision, trainer):
    out = tmp_path / "run"
    result = _run(
        trainer,
        out,
        vision,
        "num_steps=6",
        f"data.path={vision / 'prompts.jsonl'}",
        "data.image_key=image",
        f"eval.path={vision / 'eval.jsonl'}",
        "eval.every_steps=3",
        "eval.num_prompts=8",
        "loss.kl_coef=0.05",  # a KL reference: images in its forward too
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        assert r["images/per_sample"] == 1.0  # every sampled prompt had its picture
        assert r["data/skipped_rows"] == 0
        assert "response/cut_at_vision_token" in r
        assert 0.0 <= r["reward/accuracy"] <= 1.0
    trained = [r for r in records if r["train/is_skipped"] == 0.0]
    assert trained and all(r["train/num_loss_tokens"] > 0 for r in trained)
    assert any(abs(r["train/loss"]) > 0 or r["train/grad_norm"] > 0 for r in trained)
    evals = [r for r in records if "eval/reward/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 5]
    assert all(r["eval/num_samples"] == 8 for r in evals)
    assert (out / "export" / "config.json").exists()


def test_bad_image_rows_are_counted_skips(tmp_path, vision, trainer):
    rows = [json.loads(x) for x in (vision / "prompts.jsonl").read_text().splitlines()][:24]
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    for row in rows:
        shutil.copy(vision / row["image"], data / row["image"])
    (data / "images" / "broken.png").write_bytes(b"not a png")
    bad = [
        {**rows[0], "image": "images/missing.png"},  # no file
        {**rows[1], "image": "images/broken.png"},  # not an image
        {**rows[2], "image": [rows[2]["image"]] * 3},  # over data.max_images=2
        {key: value for key, value in rows[3].items() if key != "image"},  # no image field
    ]
    lines = [json.dumps(row) for row in bad + rows[4:]]
    (data / "rows.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    result = _run(
        trainer,
        out,
        vision,
        "num_steps=6",
        f"data.path={data / 'rows.jsonl'}",
        "data.image_key=image",
        "data.max_images=2",
        "eval.every_steps=0",
        "rollout.max_sampling_rounds=1",  # no refills: 6 steps draw the 24 rows once
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last = _metrics(out)[-1]  # 6 steps x 4 prompts cover the 24 rows: every bad one was drawn
    assert last["data/skipped_rows/no_image"] == 2
    assert last["data/skipped_rows/bad_image"] == 1
    assert last["data/skipped_rows/too_many_images"] == 1
    assert last["data/skipped_rows"] == 4


def test_a_text_policy_with_images_fails_before_any_model_loads(tmp_path, vision):
    text_policy = tmp_path / "text-policy"
    make_tiny_causal_lm(text_policy, arch="qwen2", hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match=r"data\.image_key='image' .* is a text model"):
        grpo_preflight.preflight(
            grpo_config.build_config(
                {
                    "task": "vision",
                    "out_dir": str(tmp_path / "run"),
                    "policy": {"model_dir": str(text_policy)},
                    "data": {"path": str(vision / "prompts.jsonl"), "image_key": "image"},
                }
            )
        )


def test_task_values_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"task='audio': use one of \('text', 'vision', 'tools'\)"):
        grpo_config.build_config({"task": "audio", "out_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"task='vision' has no embedded judge"):
        grpo_config.build_config(
            {"task": "vision", "out_dir": str(tmp_path), "reward": {"backend": "builtin"}}
        )
