"""The one way a benchmark writes its report: markdown beside its JSON, folders made.

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
    from report import write_report
    write_report(out_dir / "step_cpu.md", markdown, data=combined)  # and step_cpu.json beside

Every report of bench/ (step, engines, engines_overlap, verl/TRL, balance, rebalance, rollout_gpu,
prefill_profile, decode_attention_gpu, ...) goes through it, so a results
file is always written whole (JSON indented by one space, markdown ending in a newline) and at
the same moment as its JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report(
    md_path: Path | str,
    markdown: str,
    *,
    data: Any = None,
    json_path: Path | str | None = None,
    default: Callable[[Any], Any] | None = None,
) -> Path:
    """Write `markdown` to `md_path` and, with `data`, its JSON to `json_path` (default: the
    markdown's path with a .json suffix); parent folders made. `default` is json.dumps's (for
    values JSON has no form for, e.g. `str`). Returns the markdown's path."""
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if data is not None:
        out = Path(json_path) if json_path is not None else md_path.with_suffix(".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=default))
    return md_path
