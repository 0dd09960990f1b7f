"""A run's metrics: one JSON line per step, TensorBoard events, optionally Weights & Biases,
a few sampled completions per step (samples.jsonl and TensorBoard text), and a PNG plot.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
# A sample's text field longer than this is cut in samples.jsonl and TensorBoard (a runaway
# completion must not grow the files by megabytes a step).
MAX_SAMPLE_CHARS = 4000
# Lines of at least this many points are drawn raw (faint) and smoothed (an exponential moving
# average, debiased as TensorBoard's, of weight SMOOTHING).
MIN_POINTS_TO_SMOOTH = 8
SMOOTHING = 0.6
EVAL_PREFIX = "eval/"
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
        self.samples_path = self.out_dir / SAMPLES_FILE
        self._tb: Any = None
        self._wandb: Any = None
        check_wandb(wandb_project)
        if not is_writer:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path):
            if resume_step is not None:
                _drop_from(path, resume_step)
            elif path.exists():
                path.unlink()  # a fresh run: no stale lines from an earlier one
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

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """A few sampled completions of this step, e.g. {"prompt", "completion", "reward"}:
        one JSON line each in samples.jsonl (with "step"), a TensorBoard text table and, with
        W&B, a table "samples" (log the step's metrics first: W&B steps only go up). Text
        over MAX_SAMPLE_CHARS is cut; values JSON cannot hold are written as text."""
        if not self.is_writer or not records:
            return
        rows = [{"step": step, **{k: _cut(v) for k, v in r.items()}} for r in records]
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        if self._tb is not None:
            self._tb.add_text("samples", _markdown_table(rows), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for row in rows for k in row))
            data = [[_table_cell(row.get(c)) for c in columns] for row in rows]
            self._wandb.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def read_samples(self) -> list[dict[str, Any]]:
        if not self.samples_path.exists():
            return []
        return _parse_lines(self.samples_path.read_text(), self.samples_path)

    def read(self) -> list[dict[str, float]]:
        if not self.path.exists():
            return []
        return _parse_lines(self.path.read_text(), self.path)

    def plot(
        self, keys: Sequence[str] | None = None, path: str | Path | None = None
    ) -> Path | None:
        """One panel per key against step (default: every key that varies); returns the PNG
        path (None without matplotlib or without anything to draw). See plan_plot for what
        each panel holds: eval curves beside their training key, noisy lines smoothed, and
        keys that never change (a counter of a device not in use) left out."""
        if not self.is_writer:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed; no plot written")
            return None
        panels = plan_plot(self.read(), keys)
        if not panels:
            return None
        path = Path(path) if path is not None else self.out_dir / "metrics.png"
        fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.4 * len(panels)), squeeze=False)
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            for line in panel.lines:
                style = {"marker": "o"} if line.is_eval else {}
                if line.smoothed is not None:
                    drawn = ax.plot(line.steps, line.values, alpha=0.25)
                    ax.plot(line.steps, line.smoothed, color=drawn[0].get_color(), label=line.key)
                else:
                    ax.plot(line.steps, line.values, label=line.key, **style)
            ax.set_ylabel(panel.key)
            if len(panel.lines) > 1:
                ax.legend(fontsize=7)
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


@dataclass(frozen=True)
class PlotLine:
    key: str
    steps: list[int]
    values: list[float]
    smoothed: list[float] | None  # the EMA drawn over the faint raw line; None: raw only
    is_eval: bool


@dataclass(frozen=True)
class PlotPanel:
    key: str
    lines: list[PlotLine]


def plan_plot(records: Sequence[Mapping[str, Any]], keys: Sequence[str] | None) -> list[PlotPanel]:
    """What plot() draws. A panel per key (default: every logged key but "step"), holding the
    key's line and, for a training key "x/name", the eval curve "eval/name" when logged (an
    eval key with its training key shares that panel). Lines of MIN_POINTS_TO_SMOOTH points or
    more get a smoothed copy. A key whose finite values never change (a CUDA memory counter on
    a CPU run, a count fixed by the config) or that has none is left out, logged once."""
    present: dict[str, None] = {}
    for record in records:
        present.update(dict.fromkeys(k for k in record if k != "step"))
    wanted = list(present) if keys is None else list(keys)
    train_names = {k.rsplit("/", 1)[-1] for k in wanted if not k.startswith(EVAL_PREFIX)}
    panels, flat = [], []
    for key in wanted:
        is_eval = key.startswith(EVAL_PREFIX)
        if is_eval and key.removeprefix(EVAL_PREFIX) in train_names:
            continue  # drawn beside its training key
        line = _plot_line(records, key, is_eval=is_eval)
        if line is None:
            flat.append(key)
            continue
        lines = [line]
        eval_key = EVAL_PREFIX + key.rsplit("/", 1)[-1]
        if not is_eval and eval_key in present:
            eval_line = _plot_line(records, eval_key, is_eval=True, should_keep_flat=True)
            if eval_line is not None:
                lines.append(eval_line)
        panels.append(PlotPanel(key, lines))
    if flat:
        logger.info("plot: left out %s (no value changes)", flat)
    return panels


def _plot_line(
    records: Sequence[Mapping[str, Any]], key: str, *, is_eval: bool, should_keep_flat: bool = False
) -> PlotLine | None:
    points = [
        (int(r["step"]), float(r[key]))
        for r in records
        if key in r and isinstance(r[key], int | float) and math.isfinite(float(r[key]))
    ]
    if not points or (not should_keep_flat and len({v for _, v in points}) == 1):
        return None
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    is_smoothed = not is_eval and len(points) >= MIN_POINTS_TO_SMOOTH
    return PlotLine(key, steps, values, smooth(values) if is_smoothed else None, is_eval)


def smooth(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so that the first
    points are not pulled toward 0 (s_t = w s_{t-1} + (1 - w) x_t, divided by 1 - w^t)."""
    out, ema = [], 0.0
    for t, value in enumerate(values, 1):
        ema = weight * ema + (1 - weight) * value
        out.append(ema / (1 - weight**t))
    return out


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_SAMPLE_CHARS:
        return value[:MAX_SAMPLE_CHARS] + f" ...[{len(value) - MAX_SAMPLE_CHARS} chars cut]"
    return value


def _table_cell(value: Any) -> Any:
    """A W&B table cell: numbers and text as they are, anything else as JSON text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, default=str)


def _markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a Markdown table (what TensorBoard's text tab renders)."""
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "step"))

    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _drop_from(path: Path, step: int) -> None:
    """Drop a JSONL file's lines of steps at or after `step` (a resume re-logs them)."""
    if not path.exists():
        return
    records = _parse_lines(path.read_text(), path)
    kept = [json.dumps(r) for r in records if r.get("step", -1) < step]
    path.write_text("".join(line + "\n" for line in kept))


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
