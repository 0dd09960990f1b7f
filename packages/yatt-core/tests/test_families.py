"""yatt.core's families import downward only: the layering its package docstring states.

    runtime, cost, config   import no family
    vision                  -> cost
    data                    -> vision
    rl                      -> data, runtime, vision
    policy                  -> config, cost, data, runtime, vision

No module under a family imports the package root (`from yatt.core import ...`): the root
re-exports the families, so such an import would run back up and could close a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

NUM_GPUS = 0

CORE = Path(__file__).resolve().parents[1] / "src" / "yatt" / "core"

# The families each family may import (besides its own modules and the leaf _version).
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "cost": set(),
    "config": set(),
    "vision": {"cost"},
    "data": {"vision"},
    "rl": {"data", "runtime", "vision"},
    "policy": {"config", "cost", "data", "runtime", "vision"},
    "megatron": {"policy"},  # the public path yatt.core.megatron: a re-export of policy's
}
# Modules still at the root while issue 25's moves land: the vision modules (their folder is
# yatt/core/vision/) and the old _cost_model path (a re-export of cost's).
_ROOT_MODULE_FAMILY = {
    "_vision_cost": "vision",
    "_vision_forward": "vision",
    "_vision_inputs": "vision",
    "_row_images": "vision",
    "_cost_model": "cost",
}


def family_of(module: str) -> str | None:
    """The family of a dotted yatt.core module name; None for the root and its leaf _version."""
    parts = module.split(".")
    if parts[:2] != ["yatt", "core"] or len(parts) == 2 or parts[2] == "_version":
        return None
    if parts[2].startswith("_"):
        return _ROOT_MODULE_FAMILY.get(parts[2], parts[2])
    return parts[2]


def module_name(path: Path, core: Path) -> str:
    parts = list(path.relative_to(core.parent.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each yatt.core module `path` imports (`from yatt.core.rl import
    _losses` counts as rl; `from yatt.core import ...`, whatever the names, as the root)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m == "yatt.core" or m.startswith("yatt.core.")]


def family_violations(core: Path) -> list[str]:
    bad = []
    for path in sorted(core.rglob("*.py")):
        source = module_name(path, core)
        family = family_of(source)
        if family is None:  # the root re-exports everything
            continue
        for line, target in core_imports(path):
            where = f"{path.relative_to(core)}:{line} imports {target}"
            if target == "yatt.core":
                bad.append(f"{where}: a family never imports the package root")
                continue
            target_family = family_of(target)
            if target_family is None or target_family == family:
                continue
            if family not in ALLOWED:
                bad.append(f"{where}: {family!r} is not a known family; add it to ALLOWED")
            elif target_family not in ALLOWED[family]:
                bad.append(f"{where}: {family} may import only {sorted(ALLOWED[family])}")
    return bad


def test_families_import_downward_only():
    assert (CORE / "policy" / "_torch_policy.py").is_file()  # the walk sees the real tree
    violations = family_violations(CORE)
    assert not violations, "\n".join(violations)


def test_an_upward_import_is_caught(tmp_path):
    # A planted arrow back up (data -> policy) and an import of the root must both be named.
    core = tmp_path / "yatt" / "core"
    (core / "data").mkdir(parents=True)
    (core / "policy").mkdir()
    (core / "data" / "_batch.py").write_text(
        "from yatt.core.policy._policy import PolicyBackend\nfrom yatt.core import Batch\n"
    )
    (core / "policy" / "_policy.py").write_text("from yatt.core.data._batch import Batch\n")
    violations = family_violations(core)
    assert len(violations) == 2, violations
    assert "data/_batch.py:1 imports yatt.core.policy._policy" in violations[0]
    assert "package root" in violations[1]


def test_family_of_names_the_folder():
    assert family_of("yatt.core.rl._losses") == "rl"
    assert family_of("yatt.core.policy.megatron._policy") == "policy"
    assert family_of("yatt.core.vision._vision_cost") == "vision"
    assert family_of("yatt.core._vision_cost") == "vision"  # before its move to vision/
    assert family_of("yatt.core._version") is None
    assert family_of("yatt.core") is None
