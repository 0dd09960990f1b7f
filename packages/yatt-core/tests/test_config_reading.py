"""Reading a config: YAML files, key.sub=value overrides, --help, one-line errors (yatt.core's
config family). Expected values are what YAML 1.2 and the override grammar state, written out
by hand."""

NUM_GPUS = 0

from dataclasses import dataclass, field

import pytest

from yatt.core import (
    ConfigParser,
    config_from_dict,
    describe_config,
    exit_on_config_error,
    load_yaml,
    read_raw_config,
    read_yaml_file,
    with_override,
)


@dataclass(kw_only=True)
class _Engine:
    max_seq_len: int = 64  # tokens of context
    temperature: float = 1.0  # sampling temperature


@dataclass(kw_only=True)
class _Run:
    num_steps: int = 10  # steps to run
    out_dir: str = "runs"  # where it writes
    engine: _Engine = field(default_factory=_Engine)
    extra: dict = field(default_factory=dict)  # free-form options


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  max_seq_len: 8\nnum_steps: 3\nengine:\n  temperature: 0.5\n")
    with pytest.raises(
        ValueError, match=r"run\.yaml: line 4: duplicate key 'engine' \(first at line 1\)"
    ):
        read_yaml_file(path)
    # a merge key's values may be overridden: no duplicate
    assert load_yaml("a: &b {v: 1}\nc:\n  <<: *b\n  v: 2\n", "t") == {"a": {"v": 1}, "c": {"v": 2}}


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("out_dir=final #2", "final #2"),  # YAML would cut at " #"
        ("out_dir=#tag", "#tag"),
        ("out_dir={prompt} ### Ref {reference}", "{prompt} ### Ref {reference}"),
        ("out_dir='a # b'", "a # b"),  # quoted: YAML's own string
        ("out_dir=a#b", "a#b"),  # no space before '#': not a comment
        ("num_steps=1e3", 1000.0),
        ("num_steps=0.5", 0.5),
        ("extra={a: 1e3, b: -2E-5, c: 1.5e+2}", {"a": 1000.0, "b": -2e-5, "c": 150.0}),
        ("extra=[1, true, x]", [1, True, "x"]),
        ("out_dir={prompt}{response}", "{prompt}{response}"),  # not YAML: kept as text
    ],
)
def test_an_override_keeps_its_value_as_typed(item, expected):
    key = item.partition("=")[0]
    value = with_override({}, item)[key]
    assert value == expected and type(value) is type(expected)


def test_nested_overrides_merge_and_never_edit_their_input():
    raw = {"engine": {"max_seq_len": 8}}
    merged = with_override(raw, "engine.temperature=0.5")
    assert merged == {"engine": {"max_seq_len": 8, "temperature": 0.5}}
    assert raw == {"engine": {"max_seq_len": 8}}
    with pytest.raises(ValueError, match=r"must look like key\.sub=value"):
        with_override({}, "num_steps")
    with pytest.raises(ValueError, match=r"num_steps=3 is not a section"):
        with_override({"num_steps": 3}, "num_steps.x=1")


def test_yaml_1_2_exponent_floats_inside_free_form_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("extra: {rate: 1e3, small: 5E-4}\nnum_steps: 1e2\n")
    raw = read_yaml_file(path)
    assert raw == {"extra": {"rate": 1000.0, "small": 0.0005}, "num_steps": 100.0}
    assert config_from_dict(_Run, raw).num_steps == 100  # an exact int


def test_an_alias_bomb_is_refused_and_small_aliases_are_read():
    # 9 levels of 10 references each: 10**9 values once expanded, from a few hundred bytes.
    lines = ['a0: &a0 ["x"]']
    for level in range(1, 10):
        refs = ", ".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    with pytest.raises(ValueError, match=r"bomb\.yaml: its aliases .* expand to more than"):
        load_yaml("\n".join(lines), "bomb.yaml")
    assert load_yaml("a: &x [1, 2]\nb: *x\n", "t") == {"a": [1, 2], "b": [1, 2]}
    with pytest.raises(ValueError, match="expand to more than"):
        load_yaml("a: &x [*x]\n", "self")  # an alias of itself never ends


def test_malformed_or_non_utf8_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_steps: 3\nengine:\n  max_seq_len: [1, 2\nout_dir: x\n")
    with pytest.raises(
        ValueError, match=r"--config .*bad\.yaml: not valid YAML: line \d+, column \d+"
    ):
        read_yaml_file(bad)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"num_steps: 3\nout_dir: caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin\.yaml: line 2: byte 0xe9 is not UTF-8"):
        read_yaml_file(latin)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ValueError, match=r"scalar\.yaml: must hold a mapping of fields"):
        read_yaml_file(scalar)
    with pytest.raises(ValueError, match=r"missing\.yaml: cannot read it"):
        read_yaml_file(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert read_yaml_file(empty) == {}


def test_file_then_overrides_in_order_then_unknown_keys_named_with_the_nearest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_steps: 3\nengine: {max_seq_len: 8}\n")
    raw = read_raw_config(str(path), ["num_steps=5", "engine.temperature=0.7", "num_steps=6"])
    cfg = config_from_dict(_Run, raw)
    assert (cfg.num_steps, cfg.engine.max_seq_len, cfg.engine.temperature) == (6, 8, 0.7)
    with pytest.raises(
        ValueError, match=r"unknown config key 'engine\.temprature' .*'temperature'"
    ):
        config_from_dict(_Run, read_raw_config(None, ["engine.temprature=1"]))


def _parser() -> ConfigParser:
    parser = ConfigParser(prog="train", describe=lambda: "\n".join(describe_config(_Run)))
    parser.add_argument("--resume", action="store_true")
    return parser


def test_help_lists_every_field_with_its_default_and_comment(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for line in ("num_steps = 10  # steps to run", "engine.max_seq_len = 64  # tokens of context"):
        assert line in out


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--num_steps", "5"], "use num_steps=5"),
        (["--engine.temperature=0.7"], "use engine.temperature=0.7"),
        (["--out-dir"], "use out_dir=..."),
    ],
)
def test_a_flag_for_a_config_field_is_told_the_key_value_form(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse(argv)
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


def test_flags_and_overrides_mix_in_any_order():
    args = _parser().parse(["num_steps=5", "--resume", "engine.max_seq_len=8"])
    assert args.resume and args.overrides == ["num_steps=5", "engine.max_seq_len=8"]
    assert not args.traceback and args.config is None


def test_a_config_error_is_one_line_and_exit_code_2_unless_traceback_is_asked(capsys):
    with pytest.raises(SystemExit) as exit_info, exit_on_config_error(prog="train"):
        raise ValueError("engine.max_seq_len=0: must be >= 1;\nraise it")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("train: error: engine.max_seq_len=0: must be >= 1; raise it")
    with (
        pytest.raises(ValueError, match="must be >= 1"),
        exit_on_config_error(should_show_traceback=True),
    ):
        raise ValueError("engine.max_seq_len=0: must be >= 1")
    with pytest.raises(KeyError), exit_on_config_error():  # not a config error: as it is
        raise KeyError("x")


@dataclass(kw_only=True)
class _Optim:
    betas: tuple[float, float] = (0.9, 0.999)  # YAML writes it as a list
    phases: tuple[str, ...] | None = None


def test_a_yaml_list_given_to_a_tuple_field_is_a_tuple():
    cfg = config_from_dict(_Optim, load_yaml("betas: [0.8, 0.9]\nphases: [train]\n", "t"))
    assert cfg.betas == (0.8, 0.9) and cfg.phases == ("train",)
