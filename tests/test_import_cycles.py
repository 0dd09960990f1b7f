"""No import circle anywhere: every Python module of the libraries (packages/*/src), the
trainer (examples/) and the benchmarks (bench/) is scanned with `ast`, and a module that imports, directly or through
others, a module that imports it back fails this test with the circle printed.

What counts as an import of module B by module A:
- `import B`, `from B import name` (an edge to B), `from P import B` where P.B is a module (an
  edge to P.B, not to P), and the relative forms (`from . import B`, `from .B import name`);
- wherever the statement is: at module level, inside a function (a lazy import still makes A
  need B), and under `if TYPE_CHECKING:` (it does not run, but a reader and a type checker follow
  it: a helper that imports the trainer only to name a type, as grpo_metrics once did for
  `Scored` (now genrm.JudgedSample), closes a circle all the same, and a circle of types is
  still a circle of meaning).
Only modules of this repository count; an import of a package does not count as an import of
its submodules, nor of a submodule as one of its package (Python runs the package's
`__init__` first, but a package re-exporting its submodules is not a circle).

The trainer's modules are named as `python examples/train_grpo.py` finds them (examples/ on
sys.path): examples/grpo_data.py is `grpo_data`, examples/tasks/tiny_task.py `tasks.tiny_task`.
A bench script puts its own folder (and at times a sibling's) on sys.path, so a bench module is
named by its file's stem: bench/step/_step_setup.py is `_step_setup` (stems are unique in bench/).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles known when this test was written, each to be removed by a change in flight: the
# test fails when one of them is gone too, so the entry is deleted with the change that
# removes the circle (the way pytest's xfail(strict=True) flags a fix).
# Circles allowed for now, each with the reason and the fix; a fixed one must leave the list.
KNOWN_CYCLES: list[frozenset[str]] = []


@functools.cache
def _module_files() -> dict[str, Path]:
    """Every module of the libraries and the trainer, by its import name."""
    modules: dict[str, Path] = {}
    roots = [*sorted(ROOT.glob("packages/*/src")), ROOT / "examples"]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    for path in sorted((ROOT / "bench").rglob("*.py")):
        assert path.stem not in modules, f"{path}: its stem names another module too"
        modules[path.stem] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import in `path` of a module in `known`."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from .x import y` in package p.q's module: p.q.x; each extra dot one level up.
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                if submodule in known:
                    yield submodule, node.lineno
                elif base in known:
                    yield base, node.lineno


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}; parsed once per
    session (several tests read it; none changes it)."""
    files = _module_files()
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path, known):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (the circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative: a deep chain of imports must not hit Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_circle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as module names, first = last."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                return [*paths[node], start]
            if child in members and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"{component} is strongly connected but holds no circle")


def describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return (
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(circle))
        + f" -> {circle[-1]}"
    )


def test_the_scanner_finds_a_planted_circle_and_resolves_relative_imports(tmp_path):
    # The rule, on a hand-built package: a -> b (relative) -> c (`from p import c`) -> a (lazy,
    # inside a function) is one circle; d only imports a (no circle); e imports b under
    # TYPE_CHECKING and b imports e: a circle too.
    files = {
        "p/__init__.py": "from p.a import A\n",
        "p/a.py": "from .b import B\nA = 1\n",
        "p/b.py": "from p import c\nimport p.e\nB = 1\n",
        "p/c.py": "def f():\n    from p.a import A\n    return A\n",
        "p/d.py": "import p.a\n",
        "p/e.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    known = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    graph = {
        name: dict(_imports(name, tmp_path / rel, known))
        for rel in files
        for name in [rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")]
    }
    assert graph["p.a"] == {"p.b": 1}
    assert set(graph["p.b"]) == {"p.c", "p.e"}  # `from p import c`: the module p.c, not p
    assert strongly_connected(graph) == [["p.a", "p.b", "p.c", "p.e"]]
    assert one_circle(graph, ["p.a", "p.b", "p.c", "p.e"]) == ["p.a", "p.b", "p.c", "p.a"]


def test_bench_is_scanned_and_imports_of_the_trainer_only_its_public_step_module():
    files = _module_files()
    bench = {name for name, path in files.items() if path.is_relative_to(ROOT / "bench")}
    assert {"step", "_step_setup", "verl_runs", "verl_step"} <= bench
    graph = import_graph()
    examples = {name for name, path in files.items() if path.is_relative_to(ROOT / "examples")}
    wrong = {
        (name, target)
        for name in bench
        for target in graph[name]
        if target in examples and target != "train_grpo"
    }
    assert not wrong, f"bench/ imports the trainer's helpers, not its step functions: {wrong}"


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100, "the scan found too few modules: is ROOT right?"
    components = strongly_connected(graph)
    circles = {frozenset(c): describe(graph, one_circle(graph, c)) for c in components}
    new = [text for members, text in circles.items() if members not in KNOWN_CYCLES]
    gone = [sorted(members) for members in KNOWN_CYCLES if members not in circles]
    assert not new, "import circles:\n  " + "\n  ".join(new)
    assert not gone, (
        f"the known circle(s) {gone} are gone: delete them from KNOWN_CYCLES in {__file__}"
    )


# -- what may reach examples/ and bench/ (issue #43's "Done when") ---------------------------

# A path string that names the trainer's or the bench's folder: how code reaches a module
# there without an import statement (sys.path.insert, runpy, importlib on a file).
_OUTSIDE_PATH = re.compile(r"^(?:\.{0,2}/)?(?:examples|bench)(?:/.*)?$")


def _path_strings(path: Path) -> list[tuple[str, int]]:
    """(string, line) for each string constant in `path` that names examples/ or bench/,
    docstrings left out (prose may cite a file)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.value, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and _OUTSIDE_PATH.match(node.value)
    ]


def test_the_path_scan_finds_a_planted_reach_into_examples(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        '"""Cites examples/train_grpo.py in prose: fine."""\n'
        "import sys\n"
        "from pathlib import Path\n"
        'sys.path.insert(0, str(Path(__file__).parents[3] / "examples"))\n'
        'SCRIPT = "bench/step/step.py"\n'
        'NAME = "my examples"\n'
    )
    assert sorted(_path_strings(source)) == [("bench/step/step.py", 5), ("examples", 4)]


def test_no_package_imports_or_reaches_examples_or_bench():
    # DESIGN.md: "No package imports or calls anything under examples/ or bench/". Calls need
    # an import or a path to a file there; both are checked, over the packages' sources and
    # their tests (a package is tested alone, without the trainer).
    files = _module_files()
    graph = import_graph()
    outside = {
        name
        for name, path in files.items()
        if path.is_relative_to(ROOT / "examples") or path.is_relative_to(ROOT / "bench")
    }
    packages = {name for name, path in files.items() if path.is_relative_to(ROOT / "packages")}
    assert len(packages) > 100 and len(outside) > 50
    imports = sorted(
        f"{files[name].relative_to(ROOT)}:{graph[name][target]} imports {target}"
        for name in packages
        for target in graph[name]
        if target in outside
    )
    assert not imports, "\n".join(imports)
    reaches = sorted(
        f"{path.relative_to(ROOT)}:{line} names {text!r}"
        for path in sorted(ROOT.glob("packages/*/*/**/*.py"))
        for text, line in _path_strings(path)
    )
    assert not reaches, "\n".join(reaches)


def _trainer_attributes(path: Path) -> set[tuple[str, int]]:
    """(name, line) of each attribute `path` reads off the trainer's module: `train_grpo.X`,
    `trainer().X` and `<object>.trainer.X` (how bench/ holds the imported module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        is_trainer = (
            (isinstance(value, ast.Name) and value.id == "train_grpo")
            or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name | ast.Attribute)
                and getattr(value.func, "id", getattr(value.func, "attr", "")) == "trainer"
            )
            or (isinstance(value, ast.Attribute) and value.attr == "trainer")
        )
        if is_trainer:
            found.add((node.attr, node.lineno))
    return found


# The trainer's rollout side, in modules of its own: train_grpo.py imports their functions back,
# so `train_grpo.to_batch` is a step function as `train_grpo.train_on_batch` is.
ROLLOUT_MODULES = ("grpo_rollout", "grpo_offpolicy", "grpo_multiturn")


def _public_functions(tree: ast.Module) -> set[str]:
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def _public_step_functions() -> set[str]:
    """train_grpo.py's public functions, and those it imports from ROLLOUT_MODULES."""
    examples = ROOT / "examples"
    tree = ast.parse((examples / "train_grpo.py").read_text())
    names = _public_functions(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in ROLLOUT_MODULES:
            defined = _public_functions(ast.parse((examples / f"{node.module}.py").read_text()))
            names |= {alias.asname or alias.name for alias in node.names if alias.name in defined}
    return names


# The trainer's types a bench's step needs: the prompt its step functions take
# (grpo_prompts.Prompt, which adds the rollout request to yatt.core.Prompt), and the weight
# sync its step makes after the update (grpo_setup.WeightSync: a bench syncs as it does).
TRAINER_TYPES = {"Prompt", "WeightSync"}


def test_the_attribute_scan_finds_a_planted_helper_read(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import train_grpo\n"
        "def trainer():\n    return train_grpo\n"
        "a = train_grpo.to_batch\n"
        "b = trainer().DataConfig\n"
        "c = self.trainer.keep\n"
        "d = other.keep\n"
    )
    assert _trainer_attributes(source) == {("to_batch", 4), ("DataConfig", 5), ("keep", 6)}


def test_bench_reads_only_the_trainers_public_step_functions():
    allowed = _public_step_functions() | TRAINER_TYPES
    assert {"train_on_batch", "generate_and_score", "to_batch", "judge_view"} <= allowed
    wrong = sorted(
        f"{path.relative_to(ROOT)}:{line} reads train_grpo.{name}"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        for name, line in _trainer_attributes(path)
        if name not in allowed
    )
    assert not wrong, "bench/ takes from the trainer only its step functions:\n" + "\n".join(wrong)


def _module_level_names(tree: ast.Module) -> set[str]:
    """The public functions, classes and UPPER_CASE constants a module defines (not imports)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return {name for name in names if not name.startswith("_")}


def test_the_trainer_imports_back_every_name_its_rollout_modules_define():
    # They lived in train_grpo.py: tests, bench/ and forks read them as train_grpo.X.
    examples = ROOT / "examples"
    tree = ast.parse((examples / "train_grpo.py").read_text())
    imported = {
        node.module: {alias.asname or alias.name for alias in node.names}
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module in ROLLOUT_MODULES
    }
    missing = {
        module: sorted(names - imported.get(module, set()))
        for module in ROLLOUT_MODULES
        if (names := _module_level_names(ast.parse((examples / f"{module}.py").read_text())))
        - imported.get(module, set())
    }
    assert not missing, f"train_grpo.py does not import back {missing}"


MIN_COPY_LINES = 6  # a shorter function is a wrapper, not a copy worth one place

# Copies kept on purpose, each with its reason: a baseline a study measures against, which the
# library no longer has.
BASELINE_COPIES = {
    # the rebalance path before Batch.rebalance (rebalance.py's "before" column)
    ("bench/balance/rebalance.py", "wrap"),
}


def _function_bodies(path: Path) -> Iterator[tuple[str, int, str]]:
    """(name, line, the body's AST dump) of each function of `path` at least MIN_COPY_LINES
    long; the dump leaves out line numbers and the docstring, so a copy re-indented, moved or
    re-documented still matches."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.end_lineno - node.lineno + 1 < MIN_COPY_LINES:
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        yield node.name, node.lineno, "".join(ast.dump(statement) for statement in body)


def test_bench_holds_no_copy_of_the_trainers_or_the_packages_functions():
    # The bench measures the code users run: a function of bench/ with the body of one of the
    # trainer's (or of a package's: the streamed step lives in yatt.genrm) is a twin.
    originals: dict[str, str] = {}
    for root in (ROOT / "examples", *sorted(ROOT.glob("packages/*/src"))):
        for path in sorted(root.rglob("*.py")):
            for name, line, body in _function_bodies(path):
                originals.setdefault(body, f"{path.relative_to(ROOT)}:{line} {name}")
    assert len(originals) > 500
    copies = sorted(
        f"{path.relative_to(ROOT)}:{line} {name} copies {originals[body]}"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        for name, line, body in _function_bodies(path)
        if body in originals and (str(path.relative_to(ROOT)), name) not in BASELINE_COPIES
    )
    assert not copies, "\n".join(copies)


def test_the_copy_scan_matches_a_renamed_redocumented_copy(tmp_path):
    body = "    x = 1\n    y = x + 1\n    z = y * 2\n    w = z - 1\n    return w\n"
    (tmp_path / "a.py").write_text("def original(a):\n" + body)
    (tmp_path / "b.py").write_text('\n\ndef twin(a):\n    """Documented."""\n' + body)
    (tmp_path / "c.py").write_text("def other(a):\n" + body.replace("+ 1", "+ 2"))
    dumps = {p: list(_function_bodies(tmp_path / p)) for p in ("a.py", "b.py", "c.py")}
    assert dumps["a.py"][0][2] == dumps["b.py"][0][2]
    assert dumps["a.py"][0][2] != dumps["c.py"][0][2]
