"""Goodput accounting from RUN_DIR/resilience/timeline.jsonl (issue 5, capability 8).

Effective training time = time in kept steps / wall time (DESIGN.md section 4).

Timeline events, one JSON object per line: {"kind", "t0", "t1", "attempt", ...extra}, unix
seconds. t1 null (or absent) means an instant at t0; for "job" it means still running / died,
and the job then ends at the latest time seen in any event. A "fault" with t1 is the interval
from the fault's occurrence (t0) to its detection (t1); an instant fault is its detection.

Kept and lost steps: every "step" event is one execution of the step numbered "step". Only the
last execution (by end time) of each number is kept; earlier ones were redone after a restart or
a NaN retry and count as lost. A step event carrying "error" (its span raised) is never kept.

Precedence: several intervals may cover the same instant (a snapshot stall inside a step, a
restore inside start-up, a pre-flight inside a restart). Each instant is charged to exactly one
category, the first active one in _PRECEDENCE; the rule is "the more specific, nested activity
wins", so stalls beat steps, steps beat the fault window they overlap (a kept step is
productive by definition), and the fault window (detection) is only charged for time nothing
else explains. Wall time nothing covers is "other".
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TIMELINE_FILE = Path("resilience") / "timeline.jsonl"
CATEGORIES = ("productive", "lost_steps", "detection", "restart", "startup", "restore",
              "checkpoint", "snapshot", "eval", "preflight", "last_gasp", "other")  # fmt: skip
_PRECEDENCE = ("last_gasp", "checkpoint", "snapshot", "eval", "productive", "lost_steps",
               "restore", "preflight", "startup", "restart", "detection")  # fmt: skip
_KIND_CATEGORY = {k: k for k in ("restart", "startup", "restore", "checkpoint", "snapshot",
                                 "eval", "preflight", "last_gasp")}  # fmt: skip
_KIND_CATEGORY["fault"] = "detection"
_COLOURS = {"productive": "tab:green", "lost_steps": "tab:red", "detection": "tab:orange",
            "restart": "tab:purple", "startup": "tab:blue", "restore": "tab:cyan",
            "checkpoint": "tab:brown", "snapshot": "tab:olive", "eval": "tab:pink",
            "preflight": "tab:gray", "last_gasp": "black"}  # fmt: skip


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    goodput: float  # productive_s / wall_s
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per CATEGORIES entry
    steps_kept: int = 0
    steps_lost: int = 0
    # Per fault: t (detection, s since job start), cause, node, rank, detail, injected, attempt,
    # latency_s (t1 - t0, None for an instant), steps_lost (lost executions it caused),
    # recovery_s (fault time to the end of the first kept step started after detection).
    faults: list[dict] = field(default_factory=list)
    # Per attempt whose rank 0 reported them: {"attempt": N, "parts": {part: seconds}}, the
    # start-up broken down (train/trainer.py _startup_parts).
    startups: list[dict] = field(default_factory=list)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def read_timeline(path: Path) -> list[dict]:
    """Events of a timeline file in file order; unparsable lines (a half-written last line
    from a killed process) and events without a kind or numeric t0 are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no timeline at {path}: the run did not record one")
    events = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(ev, dict)
                and isinstance(ev.get("kind"), str)
                and _num(ev.get("t0")) is not None
            ):
                events.append(ev)
    return events


def _span(ev: dict) -> tuple[float, float | None]:
    t0 = float(ev["t0"])
    t1 = _num(ev.get("t1"))
    return t0, (None if t1 is None else max(t0, t1))  # a backwards clock step: an instant


def _window(events: list[dict]) -> tuple[float, float]:
    """Wall-clock window: from the first job start to the job's end (or the last event)."""
    times = [t for ev in events for t in _span(ev) if t is not None]
    jobs = [_span(ev) for ev in events if ev["kind"] == "job"]
    start = min(t0 for t0, _ in jobs) if jobs else min(times)
    ends = [t1 for _, t1 in jobs if t1 is not None]
    # A job event with no end (supervisor still running or killed): the last thing recorded.
    end = max(ends) if ends and all(t1 is not None for _, t1 in jobs) else max(times)
    return start, max(start, end)


def _kept_steps(events: list[dict]) -> tuple[set[int], list[int]]:
    """Indices into events of kept step executions, and of lost ones (in time order)."""
    steps = [i for i, ev in enumerate(events) if ev["kind"] == "step"]
    last: dict[object, int] = {}
    # By end time, file order breaking ties: a later execution of a number replaces earlier ones.
    for i in sorted(steps, key=lambda i: (_detected(events[i]), i)):
        ev = events[i]
        key = ev["step"] if isinstance(ev.get("step"), int) else ("unnumbered", i)
        if "error" in ev:
            last.pop(key, None)  # it still replaced what came before, but is not kept itself
        else:
            last[key] = i
    kept = set(last.values())
    lost = sorted((i for i in steps if i not in kept), key=lambda i: _span(events[i])[0])
    return kept, lost


def _charge(intervals: list[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds per category with overlaps resolved by _PRECEDENCE (sweep over boundaries)."""
    rank = {c: r for r, c in enumerate(_PRECEDENCE)}
    marks: list[tuple[float, int, int]] = []
    for a, b, cat in intervals:
        if b > a:
            marks += [(a, 1, rank[cat]), (b, -1, rank[cat])]
    marks.sort()
    active = [0] * len(_PRECEDENCE)
    out = dict.fromkeys(_PRECEDENCE, 0.0)
    prev = None
    for t, delta, r in marks:
        if prev is not None and t > prev:
            top = next((k for k, n in enumerate(active) if n > 0), None)
            if top is not None:
                out[_PRECEDENCE[top]] += t - prev
        active[r] += delta
        prev = t
    return out


def compute_goodput(events: list[dict]) -> Goodput:
    """Wall time, kept-step time and the per-category breakdown of a timeline."""
    if not events:
        return Goodput(0.0, 0.0, 0.0, dict.fromkeys(CATEGORIES, 0.0))
    w0, w1 = _window(events)
    kept, lost = _kept_steps(events)
    intervals: list[tuple[float, float, str]] = []
    for i, ev in enumerate(events):
        if ev["kind"] == "step":
            cat = "productive" if i in kept else "lost_steps"
        else:
            cat = _KIND_CATEGORY.get(ev["kind"])
        t0, t1 = _span(ev)
        if cat is not None and t1 is not None:
            intervals.append((max(t0, w0), min(t1, w1), cat))  # only wall time counts
    charged = _charge(intervals)
    wall = w1 - w0
    breakdown = {c: charged.get(c, 0.0) for c in CATEGORIES}
    # Charged time never exceeds wall (one category per instant); max() absorbs float dust.
    breakdown["other"] = max(0.0, wall - sum(charged.values()))
    productive = breakdown["productive"]
    return Goodput(
        wall_s=wall,
        productive_s=productive,
        goodput=productive / wall if wall > 0 else 0.0,
        breakdown=breakdown,
        steps_kept=len(kept),
        steps_lost=len(lost),
        faults=_fault_table(events, kept, lost, w0),
        startups=[
            {"attempt": ev.get("attempt"), "parts": ev["parts"]}
            for ev in events
            if ev["kind"] == "startup" and isinstance(ev.get("parts"), dict)
        ],
    )


def _disk_full_windows(events: list[dict]) -> list[tuple[float, float]]:
    """[(filled, released)] of the injected disk_full faults; one still in place (no release
    event: the supervisor died first) is open-ended."""
    chaos = [
        e
        for e in events
        if e["kind"] == "chaos" and str(e.get("fault", "")).startswith("disk_full")
    ]
    released = {e["fault"]: _span(e) for e in chaos if e.get("released")}
    return [released.get(e["fault"], (e["t0"], float("inf")))
            for e in chaos if not e.get("released")]  # fmt: skip


def _fault_table(events: list[dict], kept: set[int], lost: list[int], w0: float) -> list[dict]:
    faults = sorted((ev for ev in events if ev["kind"] == "fault"), key=lambda e: _detected(e))
    kept_spans = sorted((a, b) for a, b in (_span(events[i]) for i in kept) if b is not None)
    fills = _disk_full_windows(events)
    out = []
    prev_detect = float("-inf")
    for ev in faults:
        t0, t1 = _span(ev)
        # The ranks record a failed save without knowing the supervisor filled the disk.
        by_chaos = ev.get("cause") == "checkpoint_write_failed" and any(
            a <= t0 <= b for a, b in fills
        )
        detect = _detected(ev)
        # A lost execution is charged to the first fault detected after it began: steps done
        # before a kill and then redone, or the NaN step itself.
        n_lost = sum(1 for i in lost if prev_detect <= _span(events[i])[0] < detect)
        after = next((b for a, b in kept_spans if a >= detect), None)
        out.append({
            "t": detect - w0,
            "cause": ev.get("cause", "?"),
            "node": ev.get("node", ""),
            "rank": ev.get("rank"),
            "detail": ev.get("detail", ""),
            "injected": bool(ev.get("injected", False)) or by_chaos,
            "attempt": ev.get("attempt"),
            "latency_s": None if t1 is None else t1 - t0,
            "steps_lost": n_lost,
            "recovery_s": None if after is None else after - t0,
        })  # fmt: skip
        prev_detect = detect
    return out


def _detected(ev: dict) -> float:
    t0, t1 = _span(ev)
    return t0 if t1 is None else t1


def format_goodput(g: Goodput) -> str:
    """Text block for `wanka report`: headline, breakdown table, fault table."""
    lines = [f"effective training time {100 * g.goodput:.1f}% (wall {g.wall_s:.1f} s, "
             f"kept steps {g.productive_s:.1f} s)",
             f"steps: {g.steps_kept} kept, {g.steps_lost} lost (redone)"]  # fmt: skip
    lines.append(f"  {'category':12s} {'seconds':>10s} {'share':>7s}")
    for cat in CATEGORIES:
        s = g.breakdown.get(cat, 0.0)
        if s > 0 or cat in ("productive", "other"):
            share = 100 * s / g.wall_s if g.wall_s > 0 else 0.0
            lines.append(f"  {cat:12s} {s:10.1f} {share:6.1f}%")
    for st in g.startups:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in st["parts"].items() if _num(v) is not None)
        lines.append(f"start-up of attempt {st['attempt']} (s): {parts}")
    if not g.faults:
        lines.append("faults: none")
        return "\n".join(lines)
    lines.append(f"faults: {len(g.faults)}")
    lines.append(f"  {'at s':>8s}  {'cause':24s} {'node':12s} {'rank':>4s} {'injected':8s} "
                 f"{'detect s':>8s} {'recover s':>9s} {'lost steps':>10s}  detail")  # fmt: skip
    for f in g.faults:
        lat = "-" if f["latency_s"] is None else f"{f['latency_s']:.2f}"
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"
        rank = "-" if f["rank"] is None else str(f["rank"])
        lines.append(f"  {f['t']:8.1f}  {f['cause']:24s} {f['node'] or '-':12s} {rank:>4s} "
                     f"{'yes' if f['injected'] else 'no':8s} {lat:>8s} {rec:>9s} "
                     f"{f['steps_lost']:10d}  {f['detail']}")  # fmt: skip
    return "\n".join(lines)


def plot_timeline(events: list[dict], png: Path) -> Path:
    """One lane per category (raw intervals, overlaps visible), lost steps hatched in red,
    faults as markers with their occurrence-to-detection span, attempts as dotted lines."""
    # Figure + Agg canvas instead of pyplot: no display and no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    png = Path(png)
    g = compute_goodput(events)
    w0, _ = _window(events) if events else (0.0, 0.0)
    kept, _lost = _kept_steps(events) if events else (set(), [])
    lanes = [c for c in CATEGORIES if c != "other"]
    bars: dict[str, list[tuple[float, float]]] = {c: [] for c in lanes}
    for i, ev in enumerate(events):
        cat = ("productive" if i in kept else "lost_steps") if ev["kind"] == "step" else (
            _KIND_CATEGORY.get(ev["kind"]))  # fmt: skip
        t0, t1 = _span(ev)
        if cat is not None and t1 is not None:
            bars[cat].append((t0 - w0, max(t1 - t0, 1e-9)))

    fig = Figure(figsize=(12, 5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for y, cat in enumerate(lanes):
        if bars[cat]:
            lost = cat == "lost_steps"
            ax.broken_barh(bars[cat], (y - 0.4, 0.8), facecolors=_COLOURS[cat],
                           hatch="xx" if lost else None, edgecolor="darkred" if lost else "none",
                           linewidth=0.3)  # fmt: skip
    fy = lanes.index("detection")
    # A number per fault on the plot (faults close together share one label), the words in a
    # key beside it: labels never overlap however many faults there are.
    groups: list[tuple[float, list[int]]] = []
    gap = 0.015 * max(g.wall_s, 1e-9)
    for n, f in enumerate(g.faults, 1):
        ax.axvline(f["t"], color="red", linewidth=0.8, alpha=0.5)
        ax.plot([f["t"]], [fy], marker="X", color="red", markersize=9)
        if groups and f["t"] - groups[-1][0] < gap:
            groups[-1][1].append(n)
        else:
            groups.append((f["t"], [n]))
    for t, ns in groups:
        text = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
        ax.annotate(text, (t, -0.62), fontsize=8, color="red", ha="center", va="top",
                    fontweight="bold")  # fmt: skip
    if g.faults:
        key = [f"{n}: {_fault_label(f)}" for n, f in enumerate(g.faults, 1)]
        if len(key) > 14:
            key = key[:13] + [f"... {len(key) - 13} more (wanka report)"]
        ax.text(1.01, 1.0, "faults\n" + "\n".join(key), transform=ax.transAxes, fontsize=7,
                va="top", ha="left", family="monospace", color="darkred")  # fmt: skip
    starts: dict[object, float] = {}
    for ev in events:
        starts[ev.get("attempt")] = min(starts.get(ev.get("attempt"), float("inf")), ev["t0"])
    for a, t in starts.items():
        if a is not None:
            ax.axvline(t - w0, color="gray", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since job start")
    ax.set_title(f"effective training time {100 * g.goodput:.1f}% of {g.wall_s:.1f} s; "
                 f"{g.steps_kept} steps kept, {g.steps_lost} lost; {len(g.faults)} fault(s)")  # fmt: skip
    ax.grid(True, axis="x", alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    return png


def _fault_label(f: dict) -> str:
    where = f" rank {f['rank']}" if f.get("rank") is not None else ""
    return f"{f['cause']}{where}{' (injected)' if f.get('injected') else ''}"


class TimelineWriter:
    """Appends timeline events. Each event is one os.write() of one line on an O_APPEND
    descriptor: unbuffered (nothing is lost if the process dies after the call) and atomic
    with respect to other processes appending to the same file."""

    def __init__(self, path: Path, attempt: int) -> None:
        self.path = Path(path)
        self.attempt = attempt
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warned = False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # A process killed mid-line left no newline: start on a fresh line so our first event
        # is not glued to the fragment (the reader skips the fragment; blank lines are fine).
        size = os.fstat(self._fd).st_size
        if size:
            with self.path.open("rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def event(self, kind: str, t0: float, t1: float | None = None, **extra) -> None:
        """One event; t1=None is an instant (or, for "job", a job still running)."""
        ev = {"kind": kind, "t0": float(t0), "t1": None if t1 is None else float(t1),
              "attempt": self.attempt, **extra}  # fmt: skip
        try:
            os.write(self._fd, (json.dumps(ev, default=str) + "\n").encode())
        except OSError as e:  # a full disk must not kill training over its own accounting
            if not self._warned:
                self._warned = True
                print(f"wanka: timeline event not recorded ({e.strerror}); goodput figures of "
                      "this run will miss what happens meanwhile", file=sys.stderr, flush=True)  # fmt: skip

    @contextmanager
    def span(self, kind: str, **extra) -> Iterator[dict]:
        """Time the block with time.time(). Yields the extra dict, so the block can add fields
        it learns (e.g. a restore's source). If the block raises, the event is still written
        with "error" set (a step that raised is then never counted as kept)."""
        t0 = time.time()
        try:
            yield extra
        except BaseException as e:
            extra["error"] = f"{type(e).__name__}: {e}"[:200]
            raise
        finally:
            self.event(kind, t0, time.time(), **extra)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
