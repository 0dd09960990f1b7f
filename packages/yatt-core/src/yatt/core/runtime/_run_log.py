"""A run's metrics: one JSON line per step, TensorBoard events, optionally Weights & Biases,
and a PNG plot at the end.

Only the writing rank (rank 0) touches files; every rank may call `log` with the same
(already reduced) metrics. On resume, lines of steps at or after the resume step are dropped
first, so the file holds each step once even after a crash between a save and the next steps.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import secrets
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"  # a resumed run continues the same W&B run


def check_wandb(project: str | None) -> None:
    """A named W&B project needs wandb installed: call before anything expensive starts."""
    if project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"wandb_project={project!r} needs wandb: pip install wandb")


def new_wandb_run_id() -> str:
    """A fresh W&B run id. Made here, not by wandb: `wandb.util.generate_id` was removed in
    wandb 0.28.2, and W&B accepts any id of lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(12))


class RunLog:
    def __init__(
        self,
        out_dir: str | Path,
        *,
        is_writer: bool = True,
        should_use_tensorboard: bool = True,
        resume_step: int | None = None,
        wandb_project: str | None = None,
        wandb_config: Mapping[str, Any] | None = None,
    ) -> None:
        """wandb_project: also log to Weights & Biases (needs `pip install wandb`); the run
        is named after out_dir and a resumed run continues the same W&B run. wandb_config: the
        run's config, shown beside its metrics."""
        self.out_dir = Path(out_dir)
        self.is_writer = is_writer
        self.path = self.out_dir / METRICS_FILE
        self._tb: Any = None
        self._wandb: Any = None
        check_wandb(wandb_project)
        if not is_writer:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._drop_from(resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run: no stale lines from an earlier one
        if should_use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed; metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if wandb_project:
            self._wandb = self._start_wandb(wandb_project, wandb_config, resume_step)

    def _start_wandb(
        self, project: str, config: Mapping[str, Any] | None, resume_step: int | None
    ) -> Any:
        import wandb

        id_path = self.out_dir / WANDB_ID_FILE
        if resume_step is not None and id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = new_wandb_run_id()
            id_path.write_text(run_id + "\n")
        return wandb.init(
            project=project,
            name=self.out_dir.name,
            id=run_id,
            resume="allow",
            dir=str(self.out_dir),
            config=dict(config or {}),
        )

    def _drop_from(self, step: int) -> None:
        if not self.path.exists():
            return
        records = _parse_lines(self.path.read_text(), self.path)
        kept = [json.dumps(r) for r in records if r.get("step", -1) < step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.is_writer:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            # Flushed per line: a crash loses at most the step being written.
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if math.isfinite(float(value)):
                    self._tb.add_scalar(key, float(value), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(record), step=step)

    def read(self) -> list[dict[str, float]]:
        if not self.path.exists():
            return []
        return _parse_lines(self.path.read_text(), self.path)

    def plot(self, keys: Sequence[str], path: str | Path | None = None) -> Path | None:
        """One panel per key against step; returns the PNG path (None without matplotlib)."""
        if not self.is_writer:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed; no plot written")
            return None
        records = self.read()
        path = Path(path) if path is not None else self.out_dir / "metrics.png"
        fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2.4 * len(keys)), squeeze=False)
        for ax, key in zip(axes[:, 0], keys, strict=True):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _parse_lines(text: str, path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file. A torn last line (a crash or a full disk mid-write) is
    dropped with a warning; a bad line before the last is a damaged file and raises."""
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                logger.warning("%s: dropping a torn last line (%d chars)", path, len(line))
                break
            raise ValueError(
                f"{path}: line {number} of {len(lines)} is not JSON ({exc}); the file is "
                "damaged before its end: fix or remove it to resume"
            ) from exc
    return records
