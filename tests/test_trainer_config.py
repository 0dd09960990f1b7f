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


# -- issue 46 items 2, 3, 6, 7: the demo only when asked for; the resolved config saved ---------
@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> Path:
    """A tiny causal LM folder standing in for a user's model (built locally, no download)."""
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("own-model")
    make_tiny_causal_lm(path, arch="qwen2", seed=0, max_position_embeddings=4096)
    return path


@pytest.fixture()
def own_data(tmp_path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return data


def test_a_users_model_gets_real_defaults_and_the_demo_keeps_its_own(tmp_path, own_model):
    own = _read(tmp_path, f"policy.model_dir={own_model}", "data.path=x.jsonl")
    assert own.task == ""
    assert (own.rollout.max_new_tokens, own.rollout.engine.max_seq_len) == (1024, 2048)
    assert own.policy.get("lr") is None  # TorchPolicyConfig's 1e-6 once built
    demo = _read(tmp_path)  # no path at all: the embedded demo, with its values
    assert demo.task == "text"
    assert (demo.rollout.max_new_tokens, demo.rollout.engine.max_seq_len) == (4, 64)
    assert demo.policy["lr"] == 2e-3 and demo.reward.engine.max_seq_len == 96
    asked = _read(tmp_path, "task=text", f"policy.model_dir={own_model}", "policy.lr=1e-5")
    assert asked.policy["lr"] == 1e-5 and asked.rollout.max_new_tokens == 4  # yours win


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data.path=DATA"], r"policy\.model_dir is empty: .*or task=text"),
        (["policy.model_dir=MODEL"], r"data\.path is empty: .*or task=text"),
        (
            ["policy.model_dir=MODEL", "data.path=DATA"],
            r"no reward: .*reward\.judge_dir=.*reward\.functions=.*reward\.backend=openai",
        ),
        (["policy.model_dir=MODEL", "data.path=nope.jsonl"], r"data\.path='nope\.jsonl': no such"),
    ],
    ids=["no-model", "no-data", "no-reward", "data-typo"],
)
def test_your_own_run_with_a_missing_piece_fails_in_preflight_before_anything_is_built(
    tmp_path, own_model, own_data, overrides, match, monkeypatch
):
    import grpo_preflight

    built = []
    monkeypatch.setattr(grpo_preflight, "with_embedded_task", lambda cfg: built.append(cfg))
    overrides = [
        o.replace("MODEL", str(own_model)).replace("DATA", str(own_data)) for o in overrides
    ]
    if "nope" in overrides[-1]:
        overrides.append("reward.functions=[os.path:join]")
    cfg = _read(tmp_path, *overrides)
    with pytest.raises(ValueError, match=match):
        grpo_preflight.preflight(cfg, should_resume=False)
    assert built == [] and not (tmp_path / "embedded").exists()


def test_reward_functions_alone_need_no_judge_model(tmp_path, own_model, own_data):
    cfg = _read(
        tmp_path,
        f"policy.model_dir={own_model}",
        f"data.path={own_data}",
        "reward.functions=[os.path:join]",
    )
    assert cfg.reward.backend == "none" and not cfg.needs_embedded_task
    given = _read(tmp_path, "task=text", "reward.functions=[os.path:join]")
    assert given.reward.backend == "builtin"  # the demo keeps its judge beside the function


def test_dr_grpo_takes_its_length_from_the_rollout(tmp_path):
    cfg = _read(tmp_path, "loss.objective=dr_grpo", "rollout.max_new_tokens=3")
    assert cfg.loss.max_response_tokens == 3
    mine = _read(tmp_path, "loss.objective=dr_grpo", "loss.max_response_tokens=8")
    assert mine.loss.max_response_tokens == 8


def test_the_resolved_config_reads_back_to_itself(tmp_path, own_model, own_data):
    import dataclasses

    import grpo_preflight
    import grpo_setup

    raw = ["--config", "", f"policy.model_dir={own_model}", f"data.path={own_data}"]
    cfg = _read(tmp_path, *raw[2:], "reward.functions=[os.path:join]", "loss.num_epochs=2")
    cfg = grpo_preflight.preflight(cfg, should_resume=False)
    saved = grpo_setup.save_config(cfg)
    assert saved == tmp_path / "config.yaml"
    again, _ = grpo_config.read_config(["--export", f"out_dir={tmp_path}"])  # no --config
    again = grpo_preflight.preflight(again, should_check_data=False)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert again.policy.model_dir == str(own_model)


# -- issue 46 item 6: sampling knobs in the config, refused by name where no engine takes them --
def test_the_four_sampling_knobs_reach_the_engines_sampling_params(tmp_path):
    from yatt import rollout

    knobs = ("rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05")
    cfg = _read(tmp_path, *knobs, "rollout.repetition_penalty=1.1")
    sampling = rollout.SamplingParams(n=2, **cfg.rollout.sampling_knobs())
    assert (sampling.top_p, sampling.top_k) == (0.9, 20)
    assert (sampling.min_p, sampling.repetition_penalty) == (0.05, 1.1)
    off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    assert _read(tmp_path).rollout.sampling_knobs() == off


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.top_p=0", r"rollout\.top_p=0\.0: must be in \(0, 1\]"),
        ("rollout.top_k=-1", r"rollout\.top_k=-1: must be an int >= 0"),
        ("rollout.min_p=1.5", r"rollout\.min_p=1\.5: must be in \[0, 1\]"),
        ("data.chat_template_kwargs=[a]", r"data\.chat_template_kwargs=\['a'\]: a mapping"),
    ],
)
def test_sampling_knobs_out_of_range_are_refused_by_name(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        _read(tmp_path, override)


def test_a_repetition_penalty_sglang_does_not_take_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.repetition_penalty=3(\.0)?: .*sglang"):
        _read(tmp_path, "rollout.backend=sglang", "rollout.repetition_penalty=3")


# A chat template with a switch of its own, as Qwen3's enable_thinking: with it false the
# generation prompt is followed by an empty think block (Qwen3's non-thinking mode).
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_prompts_and_the_environments(tmp_path, own_model, own_data):
    import grpo_preflight
    import grpo_prompts

    from yatt.testing import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    row = {"prompt": "3+4=", "__row_index__": 0}
    endings = {}
    for kwargs in ("{}", "{enable_thinking: false}"):
        cfg = _read(
            tmp_path,
            f"policy.model_dir={own_model}",
            f"data.path={own_data}",
            "reward.functions=[os.path:join]",
            "data.apply_chat_template=true",
            f"data.chat_template_kwargs={kwargs}",
        )
        cfg = grpo_preflight.preflight(cfg, should_resume=False)  # no longer refused there
        (prompt,) = grpo_prompts.PromptEncoder(cfg, tokenizer).encode([row])
        endings[kwargs] = tokenizer.decode(prompt.ids)
    assert endings["{}"].endswith("<|im_start|>assistant\n")
    assert endings["{enable_thinking: false}"].endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    env = cfg.rollout.env_config(dict(cfg.data.chat_template_kwargs))
    assert env.chat_template_kwargs == {"enable_thinking": False}


def test_export_of_a_given_model_without_data_builds_no_embedded_task(tmp_path, own_model):
    # issue 49 F33: --export names the policy; no data path must not ask for the demo task
    import grpo_preflight

    cfg, _ = grpo_config.read_config(
        ["--export", f"out_dir={tmp_path}", f"policy.model_dir={own_model}"]
    )

    def refuse(cfg):
        raise AssertionError("the embedded task was built for an export")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_preflight, "with_embedded_task", refuse)
        cfg = grpo_preflight.preflight(cfg, should_check_data=False)
    assert cfg.policy.model_dir == str(own_model)


def test_megatron_without_cuda_is_refused_in_preflight(tmp_path, monkeypatch):
    # issue 49: before the runtime starts (the process groups), not when the policy is built
    import grpo_preflight
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(grpo_preflight, "with_embedded_task", lambda cfg: 1 / 0)
    cfg = _read(tmp_path, "backend=megatron")
    with pytest.raises(ValueError, match=r"backend='megatron' needs CUDA .*backend=torch"):
        grpo_preflight.preflight(cfg, should_resume=False)


def test_prompts_too_long_for_the_rollout_name_the_fields_that_set_the_limit(tmp_path, own_model):
    import grpo_preflight

    data = tmp_path / "long.jsonl"
    data.write_text('{"prompt": "%s", "answer": "1"}\n' % ("word " * 200))
    cfg = _read(
        tmp_path,
        f"policy.model_dir={own_model}",
        f"data.path={data}",
        "reward.functions=[os.path:join]",
        "rollout.engine.max_seq_len=64",
        "rollout.max_new_tokens=4",
    )
    with pytest.raises(ValueError) as error:
        grpo_preflight.preflight(cfg, should_resume=False)
    message = str(error.value)
    assert "rollout.engine.max_seq_len - rollout.max_new_tokens = 64 - 4 = 60 tokens" in message
    assert "max_prompt_tokens" not in message
