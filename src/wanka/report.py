"""`wanka report RUN_DIR`: loss-curve PNG and a short text summary from metrics.jsonl, plus the
goodput breakdown and a timeline PNG when the run recorded resilience/timeline.jsonl."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from wanka.train.metrics import METRICS_FILE

Row = dict[str, float]
# Set in a train job's ranks by the supervisor that draws the loss curve itself once the ranks
# are gone (resilience/supervisor.py): rank 0 then leaves it out of the job's end.
LOSS_CURVE_LATER = "WANKA_LOSS_CURVE_LATER"
# Train-loss parts drawn next to "loss" besides any key ending in "_loss".
_EXTRA_LOSS_KEYS = ("indexer_kl", "moe_balance")


def load_metrics(run_dir: Path, markers: list | None = None) -> tuple[list[dict], list[dict]]:
    """Return (train rows, eval rows) from run_dir/metrics.jsonl, each sorted by step;
    marker rows (resumes, schedule changes) are appended to `markers` when given."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {run_dir}: is this a wanka run directory?")
    train: list[dict] = []
    evals: list[dict] = []
    # Bytes that are not UTF-8 (a torn write, a disk fault) spoil their line only.
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # tolerate a half-written last line from a crashed run
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            continue
        if row.get("kind") == "train":
            train.append(row)
        elif row.get("kind") == "eval":
            evals.append(row)
        elif markers is not None:
            markers.append(row)
    train.sort(key=lambda r: r["step"])
    evals.sort(key=lambda r: r["step"])
    return train, evals


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _loss_keys(rows: list[dict]) -> list[str]:
    keys: dict[str, None] = {}  # ordered set, first-seen order
    for r in rows:
        for k in r:
            if k != "loss" and (k.endswith("_loss") or k in _EXTRA_LOSS_KEYS):
                keys[k] = None
    return list(keys)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_loss_curves(run_dir: Path, out: Path | None = None) -> Path:
    """Draw loss / lr+grad-norm / tokens-per-s panels to a PNG and return its path."""
    # Figure + Agg canvas instead of pyplot: no display needed and no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    markers: list[dict] = []
    train, evals = load_metrics(run_dir, markers)
    out = Path(out) if out is not None else run_dir / "loss_curve.png"

    fig = Figure(figsize=(10, 10), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_loss, ax_lr, ax_tps = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"wanka run: {run_dir.resolve().name}")

    # Panel 1: the trained loss, its parts, and eval points. A part is drawn only where it
    # differs from the loss (lm_loss *is* the loss after the dense warm-up): no series twice.
    drawn = []
    loss_at = dict(zip(*_series(train, "loss")))
    for key in ["loss", *_loss_keys(train)]:
        xs, ys = _series(train, key)
        if key != "loss":
            xs, ys = [x for x, y in zip(xs, ys) if loss_at.get(x) != y], [y for x, y in zip(xs, ys) if loss_at.get(x) != y]  # fmt: skip
        if xs:
            lw = 1.6 if key == "loss" else 0.9
            ax_loss.plot(xs, ys, label=key, linewidth=lw)
            drawn += ys
    xs, ys = _series(evals, "val_loss")
    if xs:
        ax_loss.plot(xs, ys, "o--", label="val_loss", color="black", markersize=4)
        drawn += ys
    if drawn:
        # Parts like moe_balance sit orders of magnitude below the LM loss: log scale shows both.
        if min(drawn) > 0:
            ax_loss.set_yscale("log")
        ax_loss.legend(loc="best", fontsize="small")
    else:
        _empty(ax_loss, "no loss data")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, alpha=0.3)

    # Panel 2: learning rate (left) and grad norm (right, twin axis: different units).
    xs, ys = _series(train, "lr")
    if xs:
        ax_lr.plot(xs, ys, color="tab:blue", label="lr")
        ax_lr.set_ylabel("lr", color="tab:blue")
    gx, gy = _series(train, "grad_norm")
    if gx:
        ax_gn = ax_lr.twinx()
        ax_gn.plot(gx, gy, color="tab:red", linewidth=0.8, alpha=0.8, label="grad_norm")
        ax_gn.set_ylabel("grad norm", color="tab:red")
    if not xs and not gx:
        _empty(ax_lr, "no lr / grad_norm data")
    ax_lr.grid(True, alpha=0.3)

    # Panel 3: throughput.
    xs, ys = _series(train, "tokens_per_s")
    if xs:
        ax_tps.plot(xs, ys, color="tab:green")
    else:
        _empty(ax_tps, "no tokens_per_s data")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(True, alpha=0.3)
    ax_tps.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are counts
    at_step: dict = {}  # markers at one step share a line and one label (no overprinting)
    for m in markers:
        kinds = at_step.setdefault(m["step"], [])
        if m["kind"] not in kinds:
            kinds.append(m["kind"])
    for step, kinds in at_step.items():  # resumes and schedule changes, on every panel
        for ax in (ax_loss, ax_lr, ax_tps):
            ax.axvline(step, color="gray", linestyle=":", linewidth=0.9)
        label = " + ".join(k.replace("_", " ") for k in kinds)
        ax_loss.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"),
                         fontsize=7, color="dimgray", ha="left", va="top", rotation=90)  # fmt: skip

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def summarize(train: list[dict], evals: list[dict], with_total: bool = True) -> list[str]:
    """Short text summary lines for `wanka report` (`with_total`: a total time line, left
    out when the goodput block gives the job's wall time: one total, not two)."""
    lines: list[str] = []
    if train:
        lines.append(f"steps          : {train[-1]['step']}")
    _, losses = _series(train, "loss")
    if losses:
        lines.append(f"last train loss: {losses[-1]:.4f}")
    _, vals = _series(evals, "val_loss")
    if vals:
        lines.append(f"val loss       : best {min(vals):.4f}, last {vals[-1]:.4f}")
    _, tps = _series(train, "tokens_per_s")
    if tps:
        lines.append(f"tokens/s       : {statistics.median(tps):,.0f} (median)")
    times = [r["time"] for r in train + evals if isinstance(r.get("time"), int | float)]
    if len(times) >= 2 and with_total:
        # First to last row: includes any downtime between a crash and its resume.
        lines.append(f"total time     : {max(times) - min(times):.1f} s")
    if not train and not evals:
        lines.append("no train or eval rows yet")
    return lines


def _report_goodput(run_dir: Path) -> list[str]:
    """Goodput block and timeline.png for a run with a timeline; [] for one without."""
    from wanka.resilience.goodput import (
        TIMELINE_FILE,
        compute_goodput,
        format_goodput,
        plot_timeline,
        read_timeline,
    )

    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        return []
    events = read_timeline(path)
    png = plot_timeline(events, run_dir / "timeline.png")
    return [format_goodput(compute_goodput(events)), f"timeline       : {png}"]


def report_main(run_dir: str) -> int:
    """Entry point of `wanka report RUN_DIR`: 0 on success, 2 for a bad run directory."""
    run = Path(run_dir)
    goodput = _report_goodput(run)
    events: list[dict] = []  # markers; teacher_eval rows tell a distill run apart
    try:
        train, evals = load_metrics(run, events)
        png = plot_loss_curves(run)
    except ValueError as e:
        if not goodput:
            print(f"wanka report: {e}", file=sys.stderr)
            return 2
        # A run that died before its first step has a timeline but no metrics: the goodput
        # block is still worth showing.
        print(f"wanka report: {e}; loss curve skipped", file=sys.stderr)
    else:
        for line in summarize(train, evals, with_total=not goodput):
            print(line)
        print(f"loss curve     : {png}")
        # Lazy: wanka.post.report imports this module's helpers (no import cycle at load).
        from wanka.post.report import is_post_run, plot_post_curves, summarize_post

        if is_post_run(train, evals, events) is not None:  # wanka distill / rl / draft
            for line in summarize_post(train, evals, events):
                print(line)
            print(f"post curves    : {plot_post_curves(run)}")
    for block in goodput:
        print(block)
    return 0
