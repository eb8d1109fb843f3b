"""Training metrics: JSONL log, optional TensorBoard, a live progress bar and the final summary.

Only the main rank writes anything, so every other rank can call the same methods for free.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def _scalar(value: Any) -> float:
    # Accepts python numbers and 0-d tensors / numpy scalars alike.
    return float(value)


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt_rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


class ProgressBar:
    """One-line progress: step/total, loss, tokens/s, ETA.

    On a TTY the line is redrawn in place; elsewhere (CI, pipes, log files) a full line is
    printed at most every `min_interval` seconds, plus always for the last step, so logs
    stay short however fast the steps are.
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO,
        min_interval: float = 2.0,
        window: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_steps
        self.stream = stream
        self.min_interval = min_interval
        self.clock = clock
        self.step_times: deque[float] = deque(maxlen=window)
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._last_print = -math.inf
        self._last_len = 0
        self._open_line = False  # TTY: a line is drawn without a trailing newline
        self._prev: tuple[int, float] | None = None  # (step, clock) fallback when no step_time
        self._first: tuple[int, float] | None = None  # first update: the ETA's wall-clock base
        self._stepped = 0.0  # step_time summed over the updates after the first

    def eta(self, step: int) -> float:
        """Remaining steps x (the recent step time + the time per step spent outside steps
        so far: evaluation, checkpoints, snapshots, which the step_time metric leaves out)."""
        if not self.step_times:
            return math.nan
        avg = sum(self.step_times) / len(self.step_times)
        overhead = 0.0
        if self._first is not None and self._prev is not None and self._prev[0] > self._first[0]:
            steps = self._prev[0] - self._first[0]
            wall = self._prev[1] - self._first[1]
            overhead = max(0.0, (wall - self._stepped) / steps)
        return (avg + overhead) * max(self.total - step, 0)

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        width = len(str(self.total))
        parts = [f"step {step:>{width}}/{self.total}"]
        if self.total > 0:
            parts[0] += f" {100.0 * step / self.total:5.1f}%"
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "tokens_per_s" in metrics:
            parts.append(f"{_fmt_rate(metrics['tokens_per_s'])} tok/s")
        parts.append(f"ETA {_fmt_duration(self.eta(step))}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        now = self.clock()
        if "step_time" in metrics:
            self.step_times.append(metrics["step_time"])
            if self._first is not None:  # steps between updates (log_every) counted alike
                self._stepped += metrics["step_time"] * (step - (self._prev or self._first)[0])
        elif self._prev is not None and step > self._prev[0]:
            # No step_time given: estimate it from wall time between updates.
            self.step_times.append((now - self._prev[1]) / (step - self._prev[0]))
        self._prev = (step, now)
        if self._first is None:
            self._first = (step, now)

        last = step >= self.total
        if self.tty:
            text = self.line(step, metrics)
            pad = " " * max(self._last_len - len(text), 0)
            self.stream.write("\r" + text + pad + ("\n" if last else ""))
            self._last_len = len(text)
            self._open_line = not last
        elif last or now - self._last_print >= self.min_interval:
            self.stream.write(self.line(step, metrics) + "\n")
            self._last_print = now
        else:
            return
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a standalone line without garbling a half-drawn TTY bar."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


class MetricsWriter:
    """Writes run_dir/metrics.jsonl (+ run_dir/tb) and draws the progress bar, main rank only."""

    def __init__(
        self,
        run_dir: Path,
        is_main: bool,
        total_steps: int,
        tensorboard: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.path = self.run_dir / METRICS_FILE
        self._file: TextIO | None = None
        self._tb: Any = None
        self._tb_enabled = tensorboard
        self.progress: ProgressBar | None = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run keeps extending the same file (see truncate_after).
        self._file = open(self.path, "a", encoding="utf-8")
        self._write_failed = False
        self._tb = self._open_tb()
        self.progress = ProgressBar(total_steps, stream if stream is not None else sys.stderr)

    def _open_tb(self, purge_step: int | None = None) -> Any:
        if not self._tb_enabled:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed: JSONL is the source of truth anyway
            return None
        return SummaryWriter(str(self.run_dir / TB_DIR), purge_step=purge_step)

    def _write(self, kind: str, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        values = {k: _scalar(v) for k, v in metrics.items()}
        row = {"kind": kind, "step": int(step), "time": time.time(), **values}
        self._append(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(f"{kind}/{k}", v, int(step))
        return values

    def log_train(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.is_main:
            return
        values = self._write("train", step, metrics)
        assert self.progress is not None
        self.progress.update(int(step), values)

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.is_main:
            return
        values = self._write("eval", step, metrics)
        assert self.progress is not None
        text = ", ".join(f"{k} {v:.4f}" for k, v in values.items())
        self.progress.message(f"eval step {int(step)}: {text}")

    def log_event(self, kind: str, step: int, **fields: Any) -> None:
        """A marker row (e.g. "resume", "schedule_change"): plotted, not a metric."""
        if not self.is_main or self._file is None:
            return
        row = {"kind": kind, "step": int(step), "time": time.time(), **fields}
        self._append(row)

    def _append(self, row: dict) -> None:
        """One JSON line, flushed (a crash loses at most the row being written). A disk that
        filled up loses the row, not the run: the file is cut back to its last whole line (the
        next row would otherwise continue a torn one) and reopened (dropping what the failed
        flush left buffered), said once, and training goes on, as past a failed checkpoint."""
        if self._file is None and not self._reopen():
            return
        at = os.fstat(self._file.fileno()).st_size
        try:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        except OSError as e:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
            try:
                os.truncate(self.path, at)
            except OSError:
                pass
            if not self._write_failed:
                print(f"wanka: metrics not written to {self.path} ({e.strerror or e}); training "
                      "goes on, later rows are tried again", file=sys.stderr, flush=True)  # fmt: skip
            self._write_failed = True
            self._reopen()

    def _reopen(self) -> bool:
        try:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError:
            self._file = None
        return self._file is not None

    def truncate_after(self, step: int, drop_evals_at: int | None = None) -> None:
        """Drop rows logged after `step` (lost work from before a resume), and the eval rows
        at `drop_evals_at` (evaluations to be done again), atomically."""
        if not self.is_main or not self.path.exists():
            return
        if self._file is not None:
            self._file.close()
        kept: list[str] = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a half-written last line from a crash
            if not isinstance(row, dict):
                continue
            if int(row.get("step", 0)) > step:  # metrics and markers alike
                continue
            if (
                row.get("kind") == "eval"
                and drop_evals_at is not None
                and row.get("step") == drop_evals_at
            ):
                continue
            kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)  # readers see either the old or the new file, never half
        self._file = open(self.path, "a", encoding="utf-8")
        if self._tb is not None:
            # purge_step makes TensorBoard hide the stale events past the checkpoint too.
            self._tb.close()
            self._tb = self._open_tb(purge_step=step + 1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


# (key, label, formatter) in display order; unknown keys follow in their dict order.
_SUMMARY_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("val_loss", "validation loss", lambda v: f"{float(v):.4f}"),
    ("train_loss", "train loss", lambda v: f"{float(v):.4f}"),
    ("tokens_per_s", "tokens/s", lambda v: f"{float(v):,.0f}"),
    ("wall_time_s", "wall time", lambda v: _fmt_duration(float(v))),
    ("steps", "steps", str),
    ("checkpoint_dir", "checkpoints", str),
    ("metrics_file", "metrics", str),
    ("loss_curve", "loss curve", str),
)


def format_summary(summary: Mapping[str, Any]) -> str:
    """Multi-line end-of-run block. Known keys get labels/units; others are printed as-is."""
    rows: list[tuple[str, str]] = []
    known = set()
    for key, label, fmt in _SUMMARY_FIELDS:
        known.add(key)
        if summary.get(key) is not None:
            if key == "wall_time_s" and summary.get("resumed_from_step"):  # a restart or resume
                label = f"wall time since step {summary['resumed_from_step']}"
            rows.append((label, fmt(summary[key])))
    for key, value in summary.items():
        if key in known or value is None:
            continue
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        rows.append((key, text))
    width = max((len(label) for label, _ in rows), default=0)
    lines = ["== wanka run summary =="]
    lines += [f"  {label:<{width}} : {text}" for label, text in rows]
    return "\n".join(lines)
