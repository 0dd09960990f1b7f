"""Sessions for the yatt monorepo.

    nox                          # lint, every package's tests, cross-package tests, readme
    nox -l                       # list sessions
    nox -s "tests(package='yatt-balance')"
    nox -s build                 # every package's wheel and sdist into dist/
    nox -s readme                # build, then each package installed BY NAME from dist/ into a
                                 # fresh virtualenv runs its README's first example verbatim

Every `tests` session builds a fresh virtualenv holding only that package, the yatt packages it
depends on and its `test` extra, so a green session proves the package installs and works alone.
Packages are discovered from packages/*/pyproject.toml: adding a folder adds its session.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
REPORTS_DIR = ROOT / ".reports"
DIST_DIR = ROOT / "dist"
TORCH_VERSION = "2.13.0"  # the version CI tests; the packages' floors say which they accept
# Sessions whose tests run on two pytest-xdist workers, one test file per worker at a time
# (module fixtures built once, a file's tests in order). Their tests spend much of their time
# starting processes, sleeping or waiting on ranks, so one CPU sits idle under a serial run on
# CI's 2 cores. `nox -s integration -- -n 0` runs one of them serially. yatt-ckpt stays serial:
# its kill -9 tests count the commits a writer makes between random kills, which a second
# worker's load starves (24 kills gave 11 commits of the 12 asked under two workers).
# Until session 23 empty: two workers saved ~13% on the heaviest integration files under load, not
# enough to risk CI's one-shot run on tests that race for ports or time their own waits; add a
# session here once an idle 2-core run shows its gain and no flake. Session 21: a serial run of
# test_multiturn_ranks, test_bench_controller, test_bench_lora and test_train_grpo_vl used 1.13
# CPUs on average (254 CPU s in 225 s); two workers took 174 s (0.77x), all passing, with another
# user on the machine. The tasks tests/conftest.py builds once are shared by the workers.
# Session 21, a clean-clone `nox` (idle) with integration, yatt-core, yatt-rollout and
# yatt-genrm on two workers: 2017 s in all (serial: ~2420 s estimated, 2644 s on CI before the
# shared-task fixtures), and two failures a serial order hides: a loss test drawing unseeded
# inputs (fixed: seeded), and tests/test_grpo_prompts.py meeting 'rollout/kv_cache' left paused
# process-wide by another file's engine closed asleep (fixed in session 23: an engine's close
# releases its tags, placement.release, so the next owner resumes them).
# Session 23: the region-tag bug fixed, `pytest tests -n 2 --dist loadfile` passed whole (484
# tests) in 457 s beside another engineer's test runs, against 744 s serial the same day: the
# integration session runs on two workers.
# Session 34: CI took 31 min (1879 s; its bound is 30). yatt-core, yatt-rollout and yatt-genrm on
# two workers, each alone on this 2-core machine: 189 s against 328 s serial (CI's report), 114
# against 224, 38 against 101; all passing. yatt-balance, yatt-placement and yatt-testing take
# under a minute serial.
PARALLEL_SESSIONS: set[str] = {"integration", "yatt-core", "yatt-rollout", "yatt-genrm"}
XDIST = "pytest-xdist==3.8.0"

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration", "readme"]
nox.options.reuse_existing_virtualenvs = False


def _read_project(package: str) -> dict:
    with open(PACKAGES_DIR / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _discover_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGES_DIR.glob("*/pyproject.toml"))


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _yatt_closure(package: str, *, with_test_extra: bool = True) -> list[str]:
    """The package and every yatt package it needs (for its tests too, unless
    with_test_extra=False), dependencies first."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        project = _read_project(name)
        reqs = list(project.get("dependencies", []))
        if with_test_extra:
            reqs += project.get("optional-dependencies", {}).get("test", [])
        for req in reqs:
            dep = _requirement_name(req)
            if dep.startswith("yatt-"):
                visit(dep)
        ordered.append(name)

    visit(package)
    return ordered


def _needs_torch(packages: list[str]) -> bool:
    for name in packages:
        project = _read_project(name)
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        if any(_requirement_name(r) == "torch" for r in reqs):
            return True
    return False


def _torch_spec() -> str:
    """The torch every session installs: $YATT_TORCH (a requirement or a wheel path), else a
    CPU wheel of TORCH_VERSION found in the folders of $PIP_FIND_LINKS, else the pin itself.

    One CPU wheel on disk serves every session (uv hard-links it from its cache), instead of
    resolving `torch` from the index, which would pull a multi-GB CUDA build."""
    if os.environ.get("YATT_TORCH"):
        return os.environ["YATT_TORCH"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        folder = folder.removeprefix("file://")
        wheels = sorted(glob.glob(os.path.join(folder, f"torch-{TORCH_VERSION}+cpu-{tag}-*.whl")))
        if wheels:
            return wheels[-1]
    return f"torch=={TORCH_VERSION}"


def _install_packages(session: nox.Session, packages: list[str], extras: str = "test") -> None:
    if _needs_torch(packages):
        session.install(_torch_spec())
    targets = [str(PACKAGES_DIR / name) for name in packages[:-1]]
    targets.append(
        f"{PACKAGES_DIR / packages[-1]}[{extras}]" if extras else str(PACKAGES_DIR / packages[-1])
    )
    session.install(*targets)


def _pytest(session: nox.Session, report_name: str, *paths: str) -> None:
    REPORTS_DIR.mkdir(exist_ok=True)
    workers = []
    if report_name in PARALLEL_SESSIONS:
        session.install(XDIST)
        workers = ["-n", "2", "--dist", "loadfile"]
    session.run(
        "pytest",
        *paths,
        *workers,
        "--durations=15",  # CI's log names where its time went
        f"--junitxml={REPORTS_DIR / (report_name + '.xml')}",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", _discover_packages())
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a virtualenv holding only that package (and its yatt deps)."""
    _install_packages(session, _yatt_closure(package))
    _pytest(session, package, str(PACKAGES_DIR / package / "tests"))


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests in tests/, with every package installed."""
    packages: list[str] = []
    for name in _discover_packages():
        for dep in _yatt_closure(name):
            if dep not in packages:
                packages.append(dep)
    if _needs_torch(packages):
        session.install(_torch_spec())
    session.install(*(f"{PACKAGES_DIR / name}[test]" for name in packages))
    _pytest(session, "integration", str(ROOT / "tests"))


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Every package's sdist, then its wheel built from that sdist, into dist/, as a release
    would publish them.

    `uv build` (pinned in requirements-dev.txt) does what `python -m build` does, in an isolated
    build environment, but installs hatchling from uv's cache: the session took 2 minutes in CI
    with pip creating two build environments per package, and needs no virtualenv of its own."""
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    for package in _discover_packages():
        session.run(
            "uv",
            "build",
            "--quiet",
            "--out-dir",
            str(DIST_DIR),
            str(PACKAGES_DIR / package),
            external=True,
        )


def _runtime_requirements(package: str) -> set[str]:
    """Names of what `pip install <package>` installs, through its yatt dependencies."""
    return {
        _requirement_name(requirement)
        for name in _yatt_closure(package, with_test_extra=False)
        for requirement in _read_project(name).get("dependencies", [])
    }


def _readme_example(package: str) -> str:
    """The first python block of the package's README: the example a user copies."""
    text = (PACKAGES_DIR / package / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    if match is None:
        raise ValueError(f"packages/{package}/README.md has no python example")
    return match.group(1)


@nox.session(requires=["build"])
@nox.parametrize("package", _discover_packages())
def readme(session: nox.Session, package: str) -> None:
    """Install the package BY NAME from dist/ into a fresh virtualenv, as a user would
    (`pip install --find-links dist yatt-balance`), and run its README example verbatim."""
    if "torch" in _runtime_requirements(package):  # else the resolver would pick a CUDA build
        session.install(_torch_spec())
    example = _readme_example(package)
    # An example that builds a tiny stand-in model says so and imports yatt-testing for it.
    extra = ["yatt-testing"] if "yatt.testing" in example and package != "yatt-testing" else []
    session.install("--find-links", str(DIST_DIR), package, *extra)
    with tempfile.TemporaryDirectory() as workdir:  # the example writes where it runs
        script = Path(workdir) / "readme_example.py"
        script.write_text(example)
        session.chdir(workdir)
        session.run("python", str(script))
