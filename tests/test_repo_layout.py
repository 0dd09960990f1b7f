"""The monorepo's shape, as DESIGN.md states it: checked so it cannot drift silently."""

NUM_GPUS = 0

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
TEST_ONLY = {"yatt-testing"}  # shipped for tests; not part of the `yatt` meta-distribution

# DESIGN.md's "depends on" column: the only yatt imports each package may make.
ALLOWED_DEPS = {
    "yatt-balance": set(),
    "yatt-ckpt": set(),
    "yatt-placement": set(),
    "yatt-testing": set(),
    "yatt-rollout": {"yatt-placement"},
    # genrm drives a placement Plan it is given (phases, memory split) but imports none: its
    # own protocols name what it calls (issue #43: the unused allowance removed).
    "yatt-genrm": {"yatt-rollout"},
    "yatt-core": {"yatt-balance", "yatt-placement"},
}


def _project(path: Path) -> dict:
    with open(path / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _version(pkg: Path) -> str:
    name = pkg.name.removeprefix("yatt-")
    text = (pkg / "src" / "yatt" / name / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def _yatt_requirements(reqs: list[str]) -> dict[str, str]:
    out = {}
    for req in reqs:
        m = re.match(r"(yatt-[a-z]+)(?:\[[a-z,]+\])?\s*(.*)", req)  # extras allowed
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def test_packages_exist():
    assert {p.name for p in PACKAGES} >= {"yatt-balance"}


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_package_layout(pkg):
    name = pkg.name.removeprefix("yatt-")
    assert (pkg / "README.md").is_file(), "every package has a README"
    assert (pkg / "tests").is_dir(), "tests live beside the package"
    assert (pkg / "src" / "yatt" / name / "__init__.py").is_file()
    assert not (pkg / "src" / "yatt" / "__init__.py").exists(), "yatt is a PEP 420 namespace"
    assert _project(pkg)["name"] == pkg.name


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_one_version_and_pinned_siblings(pkg):
    root_version = _project(ROOT)["version"]
    assert _version(pkg) == root_version
    project = _project(pkg)
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    for dep, spec in _yatt_requirements(reqs).items():
        assert spec == f"=={root_version}", f"{pkg.name} must pin {dep}=={root_version}"


def test_meta_distribution_lists_every_package():
    root = _project(ROOT)
    listed = _yatt_requirements(root["dependencies"])
    expected = {p.name for p in PACKAGES} - TEST_ONLY
    assert set(listed) == expected
    assert all(spec == f"=={root['version']}" for spec in listed.values())


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_imports_follow_the_dependency_table(pkg):
    declared = set(_yatt_requirements(_project(pkg).get("dependencies", [])))
    allowed = ALLOWED_DEPS.get(pkg.name)
    assert allowed is not None, f"add {pkg.name} to ALLOWED_DEPS (and DESIGN.md's table)"
    assert declared <= allowed, f"{pkg.name} declares {declared - allowed}, not in DESIGN.md"
    own = pkg.name.removeprefix("yatt-")
    for source in (pkg / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for mod in names:
                parts = mod.split(".")
                if parts[0] == "yatt" and len(parts) > 1 and parts[1] != own:
                    assert f"yatt-{parts[1]}" in declared, (
                        f"{source.relative_to(ROOT)} imports {mod} but {pkg.name} "
                        f"does not depend on yatt-{parts[1]}"
                    )


def _private_yatt_imports(source: Path) -> list[str]:
    """`yatt` modules or names under a leading underscore that `source` imports."""
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            modules, names = [a.name for a in node.names], []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules, names = [node.module], [a.name for a in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "yatt":
                continue
            private = [p for p in parts[1:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{source.relative_to(ROOT)}:{node.lineno} imports {module} {private}")
    return found


def test_bench_and_examples_import_public_names_only():
    # What users fork and read must show the packages' public API, so a private module can be
    # renamed or moved without breaking them.
    sources = [*(ROOT / "bench").rglob("*.py"), *(ROOT / "gpu_checks").rglob("*.py")]
    sources += (ROOT / "examples").rglob("*.py")
    assert sources
    private = [line for source in sources for line in _private_yatt_imports(source)]
    assert not private, "\n".join(private)


_SCRIPT_PATH = re.compile(r"(?<![\w/.<-])((?:bench|gpu_checks)/[\w./-]*\w\.(?:py|sh|md|yaml))\b")


def test_bench_and_gpu_check_files_named_anywhere_exist():
    # bench/ moves by study and gpu_checks/ sits at the top: a command or a doc naming a file
    # that is no longer there fails here, not on the GPU machine. bench/results/ keeps its
    # historical commands as they ran.
    texts = [ROOT / "README.md", *ROOT.glob("packages/*/README.md")]
    for folder in ("bench", "gpu_checks", "scripts", "examples", "tests"):
        texts += [
            path
            for path in (ROOT / folder).rglob("*")
            if path.suffix in {".py", ".sh", ".md", ".yaml"} and "results" not in path.parts
        ]
    missing = sorted(
        f"{text.relative_to(ROOT)} names {name}"
        for text in texts
        for name in set(_SCRIPT_PATH.findall(text.read_text()))
        if not (ROOT / name).is_file()
    )
    assert not missing, "\n".join(missing)


def test_bench_readme_maps_every_study_folder():
    # bench/README.md is the map a newcomer reads first: a study folder it does not name is
    # a study nobody finds.
    readme = (ROOT / "bench" / "README.md").read_text()
    folders = sorted(
        p.name
        for p in (ROOT / "bench").iterdir()
        if p.is_dir() and p.name not in {"results", "__pycache__"}
    )
    assert folders
    unnamed = [name for name in folders if f"| `{name}/` |" not in readme]
    assert not unnamed, f"bench/README.md does not name {unnamed}"


# Markers pytest itself knows, and the plugin each other marker needs. With --strict-markers an
# unknown marker is a collection error, so a package's tests may only use a plugin's marker when
# that plugin is in the package's own `test` extra (its nox session installs nothing else).
BUILTIN_MARKERS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
PLUGIN_MARKERS = {"timeout": "pytest-timeout", "anyio": "anyio"}


def _registered_markers() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        lines = tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":")[0].strip() for line in lines}


def _markers_used(folder: Path) -> set[str]:
    used = set()
    for path in folder.rglob("*.py"):
        used |= set(re.findall(r"pytest\.mark\.([A-Za-z_]\w*)", path.read_text()))
    return used


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_test_markers_have_their_plugin_in_the_test_extra(pkg):
    test_extra = _project(pkg).get("optional-dependencies", {}).get("test", [])
    installed = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in test_extra}
    for marker in _markers_used(pkg / "tests") - BUILTIN_MARKERS - _registered_markers():
        plugin = PLUGIN_MARKERS.get(marker)
        assert plugin is not None, f"{pkg.name}: unknown marker pytest.mark.{marker}"
        assert plugin in installed, (
            f"{pkg.name}'s tests use pytest.mark.{marker}: add {plugin!r} to its `test` extra"
        )


_MARKDOWN_WRITE = re.compile(
    r"(?:\.md\b|md_path|markdown)[^\n]*\.write_text\(|\.md['\"]\)?,\s*['\"]w"
)


def test_bench_reports_go_through_the_one_writer():
    # One report writer (bench/_common/report.py: markdown and its JSON written together);
    # a study writing its own markdown is a second one. Planted: the pattern catches both forms.
    assert _MARKDOWN_WRITE.search('(out / "x.md").write_text(text)')
    assert _MARKDOWN_WRITE.search("md_path.write_text(text)")
    assert not _MARKDOWN_WRITE.search('(out / "x.json").write_text(text)')
    writers = sorted(
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "bench").rglob("*.py")
        if path != ROOT / "bench" / "_common" / "report.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _MARKDOWN_WRITE.search(line)
    )
    assert not writers, "write reports with bench/_common/report.py's write_report:\n" + "\n".join(
        writers
    )


MAX_README_LINES = 100  # install, a short example, where to read more (issue #43: 400 was a manual)


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_package_readmes_stay_short_and_point_at_their_docs_page(pkg):
    lines = (pkg / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"{pkg.name}/README.md has {len(lines)} lines: keep install and a short example there, "
        f"move the rest to docs/{pkg.name}.md"
    )
    page = ROOT / "docs" / f"{pkg.name}.md"
    if pkg.name not in TEST_ONLY:
        assert page.is_file(), f"docs/{pkg.name}.md holds what {pkg.name}'s README leaves out"
