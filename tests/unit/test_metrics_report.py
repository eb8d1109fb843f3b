"""Metrics JSONL/progress bar and the `wanka report` plot/summary."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from wanka.report import load_metrics, plot_loss_curves, report_main
from wanka.train.metrics import MetricsWriter, ProgressBar, format_summary


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_only_main_rank_writes(tmp_path: Path) -> None:
    stream = io.StringIO()
    w = MetricsWriter(tmp_path / "r1", is_main=False, total_steps=5, stream=stream)
    w.log_train(1, {"loss": 1.0})
    w.log_eval(1, {"val_loss": 1.0})
    w.truncate_after(0)
    w.close()
    assert not (tmp_path / "r1").exists()
    assert stream.getvalue() == ""


def test_jsonl_rows_append_and_truncate(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = MetricsWriter(run, is_main=True, total_steps=10, tensorboard=False, stream=io.StringIO())
    for s in range(1, 5):
        w.log_train(s, {"loss": torch.tensor(2.0 / s), "lr": 1e-3})
    w.log_eval(4, {"val_loss": 0.7})
    w.close()

    rows = _rows(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("train", s) for s in range(1, 5)] + [
        ("eval", 4)
    ]
    assert rows[1]["loss"] == pytest.approx(1.0) and isinstance(rows[1]["loss"], float)
    assert all(isinstance(r["time"], float) for r in rows)

    # Resume from a checkpoint at step 2: steps 3-4 (and the step-4 eval) are dropped,
    # then new rows append to the same file.
    w = MetricsWriter(run, is_main=True, total_steps=10, tensorboard=False, stream=io.StringIO())
    w.truncate_after(2)
    w.log_train(3, {"loss": 0.5})
    w.close()
    rows = _rows(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 1), ("train", 2), ("train", 3)]
    assert rows[-1]["loss"] == 0.5
    assert not (run / "metrics.jsonl.tmp").exists()


def test_truncate_tolerates_partial_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "time": 0, "loss": 1}\n{"kind": "tra'
    )
    w = MetricsWriter(
        tmp_path, is_main=True, total_steps=3, tensorboard=False, stream=io.StringIO()
    )
    w.truncate_after(5)
    w.log_train(2, {"loss": 0.9})
    w.close()
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2]


def test_progress_non_tty_throttled_and_last_step_printed() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(total_steps=100, stream=stream, min_interval=2.0, clock=clock)
    for step in range(1, 101):
        clock.t += 0.1  # 100 steps over 10 s -> about one line per 2 s
        bar.update(step, {"loss": 3.0 / step, "tokens_per_s": 12345.0, "step_time": 0.1})
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert 4 <= len(lines) <= 7, lines
    last = lines[-1]
    assert "100/100" in last and "loss 0.0300" in last and "ETA 00:00" in last
    assert "12.3k tok/s" in last


def test_progress_eta_uses_moving_average() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(total_steps=1000, stream=stream, clock=clock)
    for step in range(1, 51):
        bar.update(step, {"loss": 1.0, "step_time": 5.0 if step <= 30 else 1.0})
    # Only the last 20 steps (1 s each) count: 950 steps left -> 950 s.
    assert bar.eta(50) == pytest.approx(950.0)
    assert "ETA 15:50" in bar.line(50, {"loss": 1.0})


def test_progress_tty_redraws_one_line() -> None:
    stream = TTYStream()
    bar = ProgressBar(total_steps=3, stream=stream, clock=FakeClock())
    for step in (1, 2, 3):
        bar.update(step, {"loss": 1.0, "step_time": 0.5})
    out = stream.getvalue()
    assert out.count("\r") == 3 and out.count("\n") == 1 and out.endswith("\n")
    assert "3/3" in out.rsplit("\r", 1)[-1]


def test_writer_prints_last_step_even_when_throttled(tmp_path: Path) -> None:
    stream = io.StringIO()
    w = MetricsWriter(tmp_path, is_main=True, total_steps=50, tensorboard=False, stream=stream)
    for s in range(1, 51):  # runs in well under 2 s: only first and last lines
        w.log_train(s, {"loss": 1.0, "step_time": 0.01})
    w.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) <= 3
    assert "50/50" in lines[-1] and "loss 1.0000" in lines[-1] and "ETA" in lines[-1]


def test_format_summary_known_and_unknown_keys() -> None:
    text = format_summary(
        {
            "val_loss": 2.3456,
            "tokens_per_s": 123456.7,
            "wall_time_s": 3725,
            "steps": 100,
            "checkpoint_dir": "runs/x/ckpt",
            "metrics_file": "runs/x/metrics.jsonl",
            "loss_curve": "runs/x/loss_curve.png",
            "mfu": 0.41,
        }
    )
    assert "validation loss" in text and "2.3456" in text
    assert "123,457" in text and "1:02:05" in text
    assert "runs/x/ckpt" in text and "runs/x/loss_curve.png" in text
    assert "mfu" in text and "0.41" in text
    assert len(text.splitlines()) == 9


def test_wall_time_of_a_resumed_run_says_what_it_covers() -> None:
    """After a restart or resume the process's wall time covers only this start."""
    fresh = format_summary({"wall_time_s": 60, "resumed_from_step": 0})
    resumed = format_summary({"wall_time_s": 60, "resumed_from_step": 34})
    assert "wall time " in fresh and "since" not in fresh
    assert "wall time since step 34" in resumed


def _synthetic_run(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(1, 41):
        rows.append(
            {
                "kind": "train",
                "step": s,
                "time": 1000.0 + s,
                "loss": 5.0 / s**0.3,
                "lm_loss": 4.5 / s**0.3,
                "mtp_loss": 0.4,
                "indexer_kl": 0.05,
                "moe_balance": 0.01,
                "lr": 1e-3 * min(1.0, s / 10),
                "grad_norm": 1.0 + 0.1 * s,
                "tokens_per_s": 1000.0 + s,
                "step_time": 0.5,
            }
        )
        if s % 10 == 0:
            rows.append({"kind": "eval", "step": s, "time": 1000.5 + s, "val_loss": 4.0 - s / 40})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "myrun"
    _synthetic_run(run)
    train, evals = load_metrics(run)
    assert len(train) == 40 and [r["step"] for r in evals] == [10, 20, 30, 40]

    png = plot_loss_curves(run)
    assert png == run / "loss_curve.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    assert report_main(str(run)) == 0
    out = capsys.readouterr().out
    assert "steps          : 40" in out
    assert "best 3.0000, last 3.0000" in out
    assert "1,020 (median)" in out
    assert str(png) in out


def test_plot_skips_missing_keys(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "time": 0, "loss": 2.0}\n'
        '{"kind": "train", "step": 2, "time": 1, "loss": 1.5}\n'
    )
    out = plot_loss_curves(tmp_path, out=tmp_path / "sub" / "c.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_report_bad_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main(str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no metrics.jsonl in" in err and "wanka run directory" in err
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        load_metrics(tmp_path / "missing")


def test_tensorboard_events_written(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    w = MetricsWriter(tmp_path, is_main=True, total_steps=2, stream=io.StringIO())
    w.log_train(1, {"loss": 1.0})
    w.truncate_after(1)  # reopens the writer with purge_step
    w.log_train(2, {"loss": 0.5})
    w.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_loss_parts_equal_to_the_loss_are_not_drawn_twice_and_resumes_are_marked(tmp_path):
    from wanka.report import load_metrics, plot_loss_curves, summarize
    from wanka.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, True, 6, tensorboard=False)
    for step in range(1, 7):
        kl, lm = 0.5 / step, 5.0 / step
        warm = step <= 2  # dense warm-up: the loss is the KL
        w.log_train(step, {"loss": kl if warm else lm, "lm_loss": lm, "indexer_kl": kl})
        if step == 4:
            w.log_event("resume", 4, source="disk")
    w.close()
    markers: list = []
    train, evals = load_metrics(tmp_path, markers)
    assert [m["kind"] for m in markers] == ["resume"] and len(train) == 6
    png = plot_loss_curves(tmp_path)
    assert png.is_file()
    assert not any(
        line.startswith("total time") for line in summarize(train, evals, with_total=False)
    )


def test_truncate_drops_markers_past_the_resume_step(tmp_path):
    from wanka.report import load_metrics
    from wanka.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, True, 6, tensorboard=False)
    w.log_train(1, {"loss": 1.0})
    w.log_event("resume", 5)
    w.truncate_after(3)
    w.close()
    markers: list = []
    load_metrics(tmp_path, markers)
    assert markers == []


def test_a_final_eval_to_be_done_again_is_dropped(tmp_path):
    """Killed between the final eval and the summary: the rerun resumes at the last step and
    evaluates again; the dead attempt's eval row there must not stay beside the new one
    (mid-run eval rows at the resume step are the run's, kept)."""
    import json

    from wanka.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, True, 12, tensorboard=False)
    w.log_train(8, {"loss": 1.0})
    w.log_eval(8, {"val_loss": 2.0})
    w.log_train(12, {"loss": 0.5})
    w.log_eval(12, {"val_loss": 1.5})
    w.truncate_after(12, drop_evals_at=12)
    w.log_eval(12, {"val_loss": 1.5})
    w.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows if r["kind"] in ("train", "eval")] == [
        ("train", 8),
        ("eval", 8),
        ("train", 12),
        ("eval", 12),
    ]


def test_eta_includes_time_spent_between_steps():
    """Steps of 1 s with a 10 s evaluation every 5 steps: the ETA follows the wall clock."""
    import io

    from wanka.train.metrics import ProgressBar

    now = [0.0]
    bar = ProgressBar(20, io.StringIO(), clock=lambda: now[0])
    for step in range(1, 11):
        now[0] += 1.0 + (10.0 if step == 6 else 0.0)  # the eval after step 5 shows up here
        bar.update(step, {"step_time": 1.0})
    assert bar.eta(10) == pytest.approx(10 * (19.0 / 9))  # not 10 x the 1 s step time


def test_markers_at_one_step_share_one_label(tmp_path, monkeypatch):
    """A resume that also changes the LR schedule: one line and one readable label."""
    from matplotlib.axes import Axes

    from wanka.report import plot_loss_curves
    from wanka.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, True, 6, tensorboard=False)
    for step in range(1, 7):
        w.log_train(step, {"loss": 1.0 / step})
        if step == 3:
            w.log_event("resume", 3, source="disk")
            w.log_event("lr_schedule_change", 3, message="steps 6 -> 9")
    w.close()
    labels: list = []
    real = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **k: labels.append(text) or real(self, text, *a, **k))  # fmt: skip
    assert plot_loss_curves(tmp_path).is_file()
    assert labels == ["resume + lr schedule change"]


def test_a_torn_or_foreign_line_spoils_only_itself(tmp_path: Path) -> None:
    # Bytes that are not UTF-8 and rows whose step is not an integer (another tool's JSON,
    # a hand edit) are skipped; the rows around them still load, in step order.
    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"kind": "train", "step": 2, "loss": 1.5}\n'
        b'{"kind": "train", "step": 3, "loss": \xff\xfe}\n'
        b'{"kind": "train", "step": "4", "loss": 1.2}\n'
        b'{"kind": "eval", "step": null, "val_loss": 1.0}\n'
        b'{"kind": "train", "step": 1, "loss": 2.0, "note": "caf\xe9"}\n'
    )
    train, evals = load_metrics(tmp_path)
    assert [r["step"] for r in train] == [1, 2] and evals == []
    assert train[0]["note"] == "caf\ufffd"
