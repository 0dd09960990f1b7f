"""The reference trainer's config: read from YAML and overrides (yatt.core's config family),
every numeric field in a range that fits what it controls, errors one line with exit code 2.
Nothing here loads a model: each case fails (or passes) while the config is read."""

NUM_GPUS = 0

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import grpo_config


def _read(tmp_path: Path, *overrides: str) -> grpo_config.TrainConfig:
    cfg, _ = grpo_config.read_config([f"out_dir={tmp_path}", *overrides])
    return cfg


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# -- issue 49: overrides keep their value; files read with errors naming file and line --------
def test_an_override_with_a_hash_keeps_its_value_as_typed(tmp_path):
    template = "Q {prompt} A {response} ### Ref {reference}"
    cfg = _read(tmp_path, f"reward.judge_template={template}", "export.dir=final #2")
    assert cfg.reward.judge_template == template
    assert cfg.reward.template.fields >= {"reference"}
    assert cfg.export.dir == "final #2"


def test_yaml_1_2_floats_reach_dict_fields(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward:\n  backend: openai\n  openai: {base_url: 'http://127.0.0.1:9/v1', model: m,"
        " extra_body: {min_tokens: 1e1, budget: 1e3}}\n"
    )
    cfg, _ = grpo_config.read_config(["--config", str(config), f"out_dir={tmp_path}"])
    assert cfg.reward.openai["extra_body"] == {"min_tokens": 10.0, "budget": 1000.0}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"num_steps: 3\nrollout:\n  temperature: [1\n", r"run\.yaml: not valid YAML: line \d+"),
        (b"num_steps: 3\nout_dir: caf\xe9\n", r"run\.yaml: line 2: byte 0xe9 is not UTF-8"),
        (
            b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                f"b{i}: &b{i} [{', '.join([f'*{p}'] * 10)}]\n".encode()
                for i, p in enumerate(["a", "b0", "b1", "b2", "b3", "b4", "b5"])
            ),
            r"run\.yaml: its aliases .* expand to more than",
        ),
    ],
    ids=["malformed", "not-utf8", "billion-laughs"],
)
def test_a_bad_config_file_names_the_file_and_line(tmp_path, text, match):
    config = tmp_path / "run.yaml"
    config.write_bytes(text)
    with pytest.raises(ValueError, match=match):
        grpo_config.read_config(["--config", str(config), f"out_dir={tmp_path}"])


# -- issue 49: every numeric field has a range that fits what it controls ----------------------
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.temperature=0", r"rollout\.temperature=0\.0: must be in \[0\.01, 10\.0\]"),
        ("rollout.temperature=1e-300", r"rollout\.temperature=1e-300: must be in"),
        ("rollout.temperature=1e9", r"rollout\.temperature=1000000000\.0: must be in"),
        (
            "rollout.engine.max_batch_size=100000000",
            r"rollout\.engine\.max_batch_size=100000000: must be <= 16384",
        ),
        (
            "reward.engine.max_batch_size=1e9",
            r"reward\.engine\.max_batch_size=1000000000: must be <=",
        ),
        (
            "rollout.max_new_tokens=100000",
            r"rollout\.max_new_tokens=100000 leaves no room for a prompt in "
            r"rollout\.engine\.max_seq_len=\d+",
        ),
        ("rollout.max_sampling_rounds=1e9", r"rollout\.max_sampling_rounds=1000000000: must be <="),
        (
            "reward.function_timeout_s=1e10",
            r"reward\.function_timeout_s=10000000000\.0: must be <= 86400",
        ),
        (
            "reward.openai={base_url: 'http://127.0.0.1:9/v1', model: m, max_retries: 1e9}",
            r"reward\.openai\.max_retries=1000000000: must be <= 20",
        ),
        (
            "reward.judge_template={prompt:>99999999}{response} {reference}",
            r"reward\.judge_template: \{prompt:>99999999\} has a format spec",
        ),
    ],
)
def test_numeric_fields_out_of_their_range_are_refused_naming_the_field(tmp_path, override, match):
    extra = ["reward.backend=openai"] if "openai" in override else []
    with pytest.raises(ValueError, match=match):
        _read(tmp_path, *extra, override)
    assert not (tmp_path / "embedded").exists()


def test_the_edges_of_the_ranges_are_accepted(tmp_path):
    cfg = _read(
        tmp_path,
        "rollout.temperature=0.01",
        "rollout.max_sampling_rounds=64",
        "reward.function_timeout_s=86400",
        "rollout.engine.max_batch_size=16384",
    )
    assert cfg.rollout.temperature == 0.01 and cfg.rollout.max_sampling_rounds == 64


# -- issue 46 item 8: one line, exit code 2, a hint for --key value ----------------------------
def test_a_config_error_is_one_line_with_exit_code_2(tmp_path, trainer):
    result = trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={tmp_path}", "rollout.temperature=0"],
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "rollout.temperature=0.0: must be in" in lines[0]
    shown = trainer.run(
        [
            sys.executable,
            str(TRAINER),
            f"out_dir={tmp_path}",
            "rollout.temperature=0",
            "--traceback",
        ],
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 1 and "Traceback" in shown.stderr


def test_a_flag_for_a_config_field_is_told_the_key_value_form(tmp_path, trainer):
    result = trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={tmp_path}", "--num_steps", "5"],
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "use num_steps=5" in result.stderr and "Traceback" not in result.stderr
