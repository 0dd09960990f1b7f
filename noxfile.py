"""Sessions for the yatt monorepo.

    nox                          # lint, every package's tests, cross-package tests
    nox -l                       # list sessions
    nox -s "tests(package='yatt-balance')"

Every `tests` session builds a fresh virtualenv holding only that package, the yatt packages it
depends on and its `test` extra, so a green session proves the package installs and works alone.
Packages are discovered from packages/*/pyproject.toml: adding a folder adds its session.
"""

from __future__ import annotations

import glob
import os
import re
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
REPORTS_DIR = ROOT / ".reports"

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = False


def _read_project(package: str) -> dict:
    with open(PACKAGES_DIR / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _discover_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGES_DIR.glob("*/pyproject.toml"))


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _yatt_closure(package: str) -> list[str]:
    """The package and every yatt package it needs, dependencies first."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        project = _read_project(name)
        reqs = project.get("dependencies", []) + project.get("optional-dependencies", {}).get(
            "test", []
        )
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
    # One CPU wheel on disk serves every session (uv hard-links it from its cache), instead of
    # resolving `torch` from the index, which would pull a multi-GB CUDA build.
    if os.environ.get("YATT_TORCH"):
        return os.environ["YATT_TORCH"]
    wheels = sorted(glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl"))
    return wheels[-1] if wheels else "torch==2.13.0"


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
    session.run(
        "pytest",
        *paths,
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
