"""Checks that run before an external engine (vLLM, SGLang) takes any GPU memory.

    require_engine("vllm", model_dir) -> the imported module, or a clear error naming
        the extra to install, the tested version, or the architecture the engine lacks.

The adapters were verified on one version of each engine (TESTED_VERSIONS, on a GPU, by
tests/test_gpu_engines.py); their private APIs move between releases, so another version is
refused unless YATT_ALLOW_UNTESTED_ENGINE=1 says to try it anyway (logged).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

TESTED_VERSIONS = {"vllm": "0.26.0", "sglang": "0.5.17"}
ALLOW_UNTESTED_ENV = "YATT_ALLOW_UNTESTED_ENGINE"


def check_engine_version(name: str, installed: str) -> None:
    tested = TESTED_VERSIONS[name]
    if installed == tested:
        return
    message = (
        f"{name} {installed} is installed, but yatt's {name} adapter was tested with {name} "
        f"{tested} only: `pip install 'yatt-rollout[{name}]'` installs {tested}"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s; trying it anyway (%s=1)", message, ALLOW_UNTESTED_ENV)
        return
    raise ImportError(f"{message}, or set {ALLOW_UNTESTED_ENV}=1 to try this version")


def model_architectures(model_dir: str | Path) -> list[str]:
    """The `architectures` of a local Hugging Face folder's config.json ([] when not local)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return []  # a hub id: the engine resolves it
    return list(json.loads(config.read_text()).get("architectures") or [])


def supported_architectures(name: str) -> set[str]:
    if name == "vllm":
        from vllm import ModelRegistry
    else:
        from sglang.srt.models.registry import ModelRegistry
    return set(ModelRegistry.get_supported_archs())


def require_engine(name: str, model_dir: str | Path) -> ModuleType:
    """Import the engine and check its version and the model's architecture."""
    if name not in TESTED_VERSIONS:
        raise ValueError(f"engine {name!r}: use one of {sorted(TESTED_VERSIONS)}")
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"the {name} rollout backend needs {name}: `pip install 'yatt-rollout[{name}]'` "
            f"({name} {TESTED_VERSIONS[name]}, CUDA): {exc}"
        ) from exc
    try:
        installed = version(name)
    except PackageNotFoundError:
        installed = getattr(module, "__version__", "unknown")
    check_engine_version(name, installed)
    wanted = model_architectures(model_dir)
    if wanted and not set(wanted) & supported_architectures(name):
        raise ValueError(
            f"{model_dir}: {name} {installed} cannot serve architecture {wanted}; use the "
            "built-in engine (rollout.backend=builtin) or the other engine"
        )
    return module
