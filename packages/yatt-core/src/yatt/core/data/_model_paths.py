"""Model paths as users have them: a local folder, or a Hugging Face Hub id already in the cache.

    resolve_model_dir("./qwen")              -> ./qwen                       (a folder: as is)
    resolve_model_dir("Qwen/Qwen3-0.6B")     -> $HF_HUB_CACHE/models--Qwen--Qwen3-0.6B/snapshots/<commit>

A Hub id is looked up in the cache only (huggingface_hub's local_files_only, the semantics of
HF_HUB_OFFLINE=1): nothing is downloaded, so a cluster node without network fails at once with
what to run, instead of hanging in a download's retries.
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_dir(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The local folder of a model: `name_or_path` itself if it is a folder, else the snapshot
    of the Hub id `name_or_path` ("org/name") in the Hugging Face cache.

    revision: a branch, tag or commit of the Hub id (default "main"). cache_dir: the hub cache
    (default $HF_HUB_CACHE, else $HF_HOME/hub, read at call time). Never downloads; ValueError
    saying how to fetch the model when it is not there.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model {text!r} is a file; pass a model folder or a Hub id 'org/name'")
    if not _is_repo_id(text):
        raise ValueError(f"model folder {text!r} does not exist (and it is not a Hub id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = Path(cache_dir).expanduser() if cache_dir is not None else _hub_cache_dir()
    at = f"@{revision}" if revision else ""
    try:
        snapshot = Path(
            snapshot_download(
                text, revision=revision, cache_dir=cache, local_files_only=True, repo_type="model"
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError) as err:
        raise ValueError(
            f"model {text + at!r} is not a local folder, and the Hugging Face cache {str(cache)!r} "
            "has no snapshot of it (nothing is downloaded here). Fetch it once where the network "
            f"is reachable, into this cache: `HF_HUB_CACHE={cache} hf download {text}"
            f"{' --revision ' + revision if revision else ''}`; or download it to a folder "
            f"(`hf download {text} --local-dir DIR`) and pass DIR"
        ) from err
    if not (snapshot / "config.json").is_file():
        raise ValueError(
            f"model {text + at!r}: its snapshot {str(snapshot)!r} in the Hugging Face cache has "
            f"no config.json (an interrupted download?); fetch it again: `hf download {text}`"
        )
    return snapshot


def _hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now (HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/...)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_root = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache_root).expanduser() / "huggingface" / "hub"


def _is_repo_id(text: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
