"""Goodput accounting from a resilience timeline, its plot, and `wanka report` integration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wanka.report import report_main
from wanka.resilience.goodput import (
    CATEGORIES,
    TIMELINE_FILE,
    TimelineWriter,
    compute_goodput,
    format_goodput,
    plot_timeline,
    read_timeline,
)

B = 1_700_000_000.0  # unix base time; events below are given relative to it


def ev(kind: str, t0: float, t1: float | None = None, attempt: int = 0, **extra) -> dict:
    return {"kind": kind, "t0": B + t0, "t1": None if t1 is None else B + t1,
            "attempt": attempt, **extra}  # fmt: skip


def restart_timeline() -> list[dict]:
    """100 s job: 5 steps, a kill at 36 s detected at 40 s, restore from the step-3 snapshot,
    steps 3-4 redone (lost), steps 5-9, a checkpoint, an eval, a last-gasp checkpoint."""
    e = [ev("job", 0, 100), ev("preflight", 0, 2, ok=True), ev("startup", 2, 10)]
    e.append(ev("restore", 9, 10, source="none", step=0))  # nested in start-up
    e += [ev("step", 10 + 5 * s, 15 + 5 * s, step=s) for s in range(5)]  # steps 0-4, 10..35
    e.append(ev("snapshot", 14, 15))  # stall inside step 0
    e.append(ev("fault", 36, 40, cause="process_crash", rank=1, node="n0", detail="kill -9",
                injected=True))  # fmt: skip
    e.append(ev("restart", 40, 45))
    e.append(ev("preflight", 41, 42, ok=True))  # nested in the restart
    e.append(ev("startup", 45, 50, attempt=1))
    e.append(ev("restore", 48, 50, attempt=1, source="memory", step=3))
    e += [ev("step", 50 + 5 * i, 55 + 5 * i, attempt=1, step=3 + i) for i in range(7)]  # 3-9
    e += [ev("checkpoint", 85, 88, attempt=1), ev("eval", 88, 90, attempt=1)]
    e.append(ev("last_gasp", 95, 98, attempt=1))
    return e


def test_restart_redone_steps_and_breakdown() -> None:
    g = compute_goodput(restart_timeline())
    assert g.wall_s == pytest.approx(100.0)
    expected = {
        "productive": 49.0,  # steps 0-2 (15 s) minus the 1 s snapshot, plus steps 3-9 (35 s)
        "lost_steps": 10.0,  # the first executions of steps 3 and 4
        "detection": 4.0,
        "restart": 4.0,  # 40..45 minus the nested pre-flight
        "startup": 10.0,  # 2..10 minus restore (7 s) + 45..50 minus restore (3 s)
        "restore": 3.0,
        "checkpoint": 3.0,
        "snapshot": 1.0,
        "eval": 2.0,
        "preflight": 3.0,
        "last_gasp": 3.0,
        "other": 8.0,  # 35..36, 90..95, 98..100
    }
    assert set(g.breakdown) == set(CATEGORIES)
    assert g.breakdown == pytest.approx(expected)
    assert sum(g.breakdown.values()) == pytest.approx(g.wall_s)
    assert g.productive_s == pytest.approx(49.0) and g.goodput == pytest.approx(0.49)
    assert (g.steps_kept, g.steps_lost) == (10, 2)
    [f] = g.faults
    assert f["cause"] == "process_crash" and f["node"] == "n0" and f["rank"] == 1
    assert f["injected"] is True and f["t"] == pytest.approx(40.0)
    assert f["latency_s"] == pytest.approx(4.0)
    assert f["steps_lost"] == 2
    assert f["recovery_s"] == pytest.approx(19.0)  # occurrence (36) to end of redone step 3 (55)


def test_nan_retry_and_missing_job_end() -> None:
    e = [ev("job", 0)]  # supervisor still running: no end
    e += [ev("step", 0, 2, step=0), ev("step", 2, 4, step=1), ev("step", 4, 6, step=2)]
    e.append(ev("fault", 6, cause="nan", rank=None, node="n1", detail="loss=nan"))  # instant
    e += [ev("step", 6, 8, step=2), ev("step", 8, 10, step=3)]
    g = compute_goodput(e)
    assert g.wall_s == pytest.approx(10.0)  # ends at the last event
    assert g.productive_s == pytest.approx(8.0) and g.breakdown["lost_steps"] == pytest.approx(2)
    assert g.goodput == pytest.approx(0.8)
    assert (g.steps_kept, g.steps_lost) == (4, 1)
    [f] = g.faults
    assert f["latency_s"] is None and f["steps_lost"] == 1 and f["rank"] is None
    assert f["recovery_s"] == pytest.approx(2.0)


def test_overlaps_clipping_and_errors() -> None:
    e = [ev("job", 0, 10)]
    e.append(ev("startup", -5, 2))  # before the job start: only 0..2 counts
    e.append(ev("step", 2, 6, step=0))
    e.append(ev("snapshot", 3, 4))
    e.append(ev("checkpoint", 3.5, 4.5))  # overlaps the snapshot and the step
    e.append(ev("fault", 5, 7, cause="slow", node="n2"))  # a kept step beats its fault window
    e.append(ev("step", 7, 9, step=1, error="RuntimeError: boom"))  # raised: never kept
    e.append(ev("step", 9, 12, step=2))  # past the job end: 9..10 counts
    g = compute_goodput(e)
    b = g.breakdown
    assert b["startup"] == pytest.approx(2.0)
    assert b["checkpoint"] == pytest.approx(1.0)  # checkpoint beats snapshot where they overlap
    assert b["snapshot"] == pytest.approx(0.5)
    assert b["productive"] == pytest.approx(2.5 + 1.0)  # step 0 minus stalls, step 2 clipped
    assert b["detection"] == pytest.approx(1.0)  # 6..7 only
    assert b["lost_steps"] == pytest.approx(2.0)
    assert b["other"] == pytest.approx(0.0)
    assert (g.steps_kept, g.steps_lost) == (2, 1)
    assert sum(b.values()) == pytest.approx(10.0)
    # A later execution of a step that raised is kept.
    g2 = compute_goodput([*e, ev("step", 10, 11, step=1)])
    assert (g2.steps_kept, g2.steps_lost) == (3, 1)


def test_empty_timeline() -> None:
    g = compute_goodput([])
    assert g.wall_s == 0 and g.goodput == 0 and g.faults == []
    assert "effective training time 0.0%" in format_goodput(g)


def test_read_timeline_tolerates_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    good = [ev("job", 0, 5), ev("step", 0, 5, step=0)]
    path.write_text(
        json.dumps(good[0]) + "\n\nnot json\n" + json.dumps({"kind": "step", "t0": "x"}) + "\n"
        + json.dumps(good[1]) + '\n{"kind": "step", "t0": 17000'
    )  # fmt: skip
    assert read_timeline(path) == good
    with pytest.raises(ValueError, match="no timeline at"):
        read_timeline(tmp_path / "missing.jsonl")


def test_writer_span_and_fragment(tmp_path: Path) -> None:
    path = tmp_path / "r" / "resilience" / "timeline.jsonl"
    with TimelineWriter(path, attempt=2) as w:
        w.event("job", B)
        with w.span("restore", source="disk") as extra:
            extra["step"] = 7
        with pytest.raises(RuntimeError), w.span("step", step=8):
            raise RuntimeError("nan loss")
    # A crash mid-line; the next writer must start on a fresh line.
    with path.open("a") as f:
        f.write('{"kind": "st')
    with TimelineWriter(path, attempt=3) as w:
        w.event("fault", B + 1, B + 2, cause="hang", node="n0")
    events = read_timeline(path)
    assert [e["kind"] for e in events] == ["job", "restore", "step", "fault"]
    assert events[0]["t1"] is None and events[0]["attempt"] == 2
    assert events[1]["source"] == "disk" and events[1]["step"] == 7
    assert events[1]["t1"] >= events[1]["t0"]
    assert events[2]["error"] == "RuntimeError: nan loss"
    assert events[3]["attempt"] == 3 and events[3]["t1"] == B + 2


_APPENDER = """
import sys
from pathlib import Path
from wanka.resilience.goodput import TimelineWriter
w = TimelineWriter(Path(sys.argv[1]), attempt=int(sys.argv[2]))
for i in range(300):
    w.event("step", 1.0 * i, 1.0 * i + 0.5, step=i, pad="x" * 200)
"""


def test_two_processes_append(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, str(path), str(a)]) for a in (0, 1)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    # A writer that opens while the other's append is in flight may see the file's last byte
    # before it is written and start on a fresh line: a blank line, which readers skip.
    lines = [line for line in path.read_text().splitlines() if line]
    assert len(lines) == 600
    events = [json.loads(line) for line in lines]  # no torn or glued line
    for a in (0, 1):
        assert [e["step"] for e in events if e["attempt"] == a] == list(range(300))


def test_format_and_plot(tmp_path: Path) -> None:
    events = restart_timeline()
    text = format_goodput(compute_goodput(events))
    lines = text.splitlines()
    assert lines[0] == "effective training time 49.0% (wall 100.0 s, kept steps 49.0 s)"
    assert "10 kept, 2 lost" in lines[1]
    assert any(line.split()[:3] == ["lost_steps", "10.0", "10.0%"] for line in lines)
    fault = next(line for line in lines if "process_crash" in line)
    assert fault.split()[:9] == ["40.0", "process_crash", "n0", "1", "yes", "4.00", "19.00",
                                 "2", "kill"]  # fmt: skip
    png = plot_timeline(events, tmp_path / "sub" / "timeline.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def _metrics(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "train", "step": s, "time": B + s, "loss": 2.0 / s} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _timeline(run: Path) -> None:
    path = run / TIMELINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in restart_timeline()))


def test_report_with_and_without_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain"
    _metrics(plain)
    assert report_main(str(plain)) == 0
    out = capsys.readouterr().out
    assert "steps          : 3" in out and "effective training time" not in out
    assert not (plain / "timeline.png").exists()

    run = tmp_path / "resilient"
    _metrics(run)
    _timeline(run)
    assert report_main(str(run)) == 0
    out = capsys.readouterr().out
    assert "steps          : 3" in out and "loss curve" in out
    assert "effective training time 49.0% (wall 100.0 s, kept steps 49.0 s)" in out
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert f"timeline       : {run / 'timeline.png'}" in out

    # Died before the first step: a timeline but no metrics still reports goodput.
    early = tmp_path / "early"
    _timeline(early)
    assert report_main(str(early)) == 0
    captured = capsys.readouterr()
    assert "effective training time" in captured.out
    assert "no metrics.jsonl" in captured.err and "loss curve skipped" in captured.err


def test_failed_saves_inside_an_injected_disk_full_are_marked_injected() -> None:
    """The ranks record checkpoint_write_failed without knowing the supervisor filled the
    disk; the report marks those inside the fill's window (fired .. released) injected, and a
    failure after the release, or with no fill at all, not."""
    e = [ev("job", 0, 100), ev("step", 1, 99, step=0)]
    e.append(ev("chaos", 10, 10, fault="disk_full@t=10,for=30"))  # fired
    e.append(ev("chaos", 10, 40, fault="disk_full@t=10,for=30", released=True))
    e.append(ev("fault", 12, 14, cause="checkpoint_write_failed", detail="ENOSPC"))
    e.append(ev("fault", 60, 61, cause="checkpoint_write_failed", detail="EIO"))
    e.append(ev("fault", 70, 71, cause="process_crash", rank=0))
    injected = [f["injected"] for f in compute_goodput(e).faults]
    assert injected == [True, False, False]
    # a fill never released (the supervisor died first) stays open
    open_fill = [x for x in e if not x.get("released")]
    assert [f["injected"] for f in compute_goodput(open_fill).faults] == [True, True, False]


def test_startup_parts_are_reported_per_attempt() -> None:
    from wanka.train.trainer import _startup_parts

    parts = _startup_parts(B, B + 2.5, [("process group", B + 3.0), ("model", B + 4.25)], env={})
    assert parts == {"to the trainer": 2.5, "process group": 0.5, "model": 1.25}
    e = restart_timeline()
    e[2]["parts"] = parts  # attempt 0's start-up; attempt 1's (an older rank) has none
    g = compute_goodput(e)
    assert g.startups == [{"attempt": 0, "parts": parts}]
    assert g.breakdown == compute_goodput(restart_timeline()).breakdown  # parts change nothing
    text = format_goodput(g)
    assert "start-up of attempt 0 (s): to the trainer 2.50, process group 0.50, model 1.25" in text


def test_startup_parts_split_the_launch_where_the_launch_path_left_marks() -> None:
    from wanka.train.trainer import _startup_parts

    env = {"WANKA_ORDERS_TIME": repr(B + 0.25), "WANKA_RANK_START_TIME": repr(B + 1.75)}
    parts = _startup_parts(B, B + 2.5, [("model", B + 3.0)], env=env)
    assert parts == {"orders": 0.25, "rendezvous + ranks": 1.5, "to the trainer": 0.75,
                     "model": 0.5}  # fmt: skip
    # Another host's clock (a mark before the launch, or after the entry) is clamped: the
    # parts still add up to the whole start-up and none is negative.
    skewed = {"WANKA_ORDERS_TIME": repr(B - 5.0), "WANKA_RANK_START_TIME": repr(B + 9.0)}
    parts = _startup_parts(B, B + 2.5, [], env=skewed)
    assert parts == {"orders": 0.0, "rendezvous + ranks": 2.5, "to the trainer": 0.0}
    # A mark that is not a number is left out, its time counted in the next part.
    parts = _startup_parts(B, B + 2.5, [], env={"WANKA_ORDERS_TIME": "soon"})
    assert parts == {"to the trainer": 2.5}
