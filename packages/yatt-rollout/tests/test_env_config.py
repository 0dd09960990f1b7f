"""Environment and tool loading: schemas from type hints and docstrings, and every bad input a
ValueError naming the field before any model loads."""

NUM_GPUS = 0

import textwrap

import pytest

from yatt.rollout.env import EnvConfig, build_env_kinds

ENV_FILE = '''
class MathEnv:
    def reset(self, **row):
        self.answer = row.get("answer")
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def submit(self, answer: str) -> str:
        """Give the final answer.

        Args:
            answer: the answer
        """
        return "ok"

    def get_reward(self) -> float:
        return 1.0

    def _helper(self):
        pass

    @staticmethod
    def parse(text):
        return text


class Empty:
    def reset(self, **row):
        return None


class NoHints:
    def act(self, x):
        """Act.

        Args:
            x: what
        """


def search(query: str, k: int = 3) -> str:
    """Search the index.

    Args:
        query: what to look for
        k: how many results
    """
    return query


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: x
        b: y
    """
    return a + b
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    return str(path)


def test_public_methods_are_tools_with_schemas_from_hints_and_docstring(env_file):
    kinds = build_env_kinds([f"{env_file}:MathEnv"], [f"{env_file}:search"])
    kind = kinds["MathEnv"]
    assert kind.tool_names == ["add", "submit", "search"]  # not reset/get_reward/_helper/static
    add = kind.schemas[0]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first"},
        "b": {"type": "integer", "description": "the second"},
    }
    assert add["parameters"]["required"] == ["a", "b"]
    search = kind.schemas[2]["function"]
    assert search["parameters"]["required"] == ["query"]  # k has a default
    assert kind.has_reward and set(kind.functions) == {"search"}


def test_function_tools_alone(env_file):
    kinds = build_env_kinds([], [f"{env_file}:search"])
    assert list(kinds) == [""] and kinds[""].factory is None


@pytest.mark.parametrize(
    ("environment", "tools", "field", "fragment"),
    [
        (["{f}:Nope"], [], "EnvConfig.environment", "has no 'Nope'"),
        (["/no/such/file.py:X"], [], "EnvConfig.environment", "does not import"),
        (["{f}:Empty"], [], "EnvConfig.environment", "has no tools"),
        (["{f}:NoHints"], [], "EnvConfig.environment", "type hint"),
        (["{f}:search"], [], "EnvConfig.environment", "is not a class"),
        (["{f}:MathEnv"], ["{f}:add"], "EnvConfig.environment", "name of a tool"),
        ([], ["{f}:search", "{f}:search"], "EnvConfig.tools", "two tools are named"),
        ([], ["no_such_module_xyz:f"], "EnvConfig.tools", "does not import"),
    ],
    ids=["no-attr", "no-file", "no-tools", "no-hints", "not-class", "clash", "dup", "no-module"],
)
def test_bad_environment_or_tools(env_file, environment, tools, field, fragment):
    environment = [e.format(f=env_file) for e in environment]
    tools = [t.format(f=env_file) for t in tools]
    with pytest.raises(ValueError, match=field) as info:
        build_env_kinds(environment, tools)
    assert fragment in str(info.value)


def test_a_module_that_raises_on_import_is_a_value_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise SystemExit(3)\n")
    with pytest.raises(ValueError, match="does not import"):
        build_env_kinds([f"{path}:X"], [])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_turns": 0}, "max_turns=0"),
        ({"max_turns": True}, "max_turns=True"),
        ({"tool_parser": "nope"}, "tool_parser='nope' is unknown"),
        ({"tool_timeout_s": 0.0}, "tool_timeout_s=0.0"),
        ({"max_trajectory_tokens": 0}, "max_trajectory_tokens=0"),
        ({"max_tool_output_bytes": -1}, "max_tool_output_bytes=-1"),
        ({"environment": ("a.py:A", "b.py:B")}, "route_key"),
        ({"tools": 3}, "EnvConfig.tools=3"),
    ],
    ids=["turns0", "turns-bool", "parser", "timeout", "tokens", "bytes", "route", "tools-type"],
)
def test_bad_config_values(kwargs, fragment):
    kwargs = {"tools": ("t.py:f",), **kwargs}
    with pytest.raises(ValueError, match="EnvConfig") as info:
        EnvConfig(**kwargs)
    assert fragment in str(info.value)


def test_nothing_configured_is_an_error_when_built():
    assert EnvConfig().environment == ()  # the default: no multi-turn rollout
    with pytest.raises(ValueError, match=r"EnvConfig\.environment and EnvConfig\.tools"):
        build_env_kinds([], [])


def test_config_takes_a_single_spec_string():
    assert EnvConfig(environment="e.py:E").environment == ("e.py:E",)
