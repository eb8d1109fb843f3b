"""`wanka report` on distill / rl / draft runs: post_curves.png, the gap-closure summary, and no post
panels for a pre-training run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from wanka.post.report import gap_closed, is_post_run, plot_post_curves, summarize_post
from wanka.report import load_metrics, report_main
from wanka.train.metrics import MetricsWriter

PNG = b"\x89PNG\r\n\x1a\n"


def _distill_run(run: Path, teacher_code: float = 2.0, teacher_prose: float = 2.5) -> None:
    """The rows `wanka distill` writes, through the same MetricsWriter (exact row shapes)."""
    w = MetricsWriter(run, is_main=True, total_steps=4, tensorboard=False, stream=io.StringIO())  # fmt: skip
    # The code teacher is the better one on code, the prose teacher on prose.
    w.log_event("teacher_eval", 0, teacher="code", **{"val_loss/code": teacher_code, "val_loss/prose": 3.5})  # fmt: skip
    w.log_event("teacher_eval", 0, teacher="prose", **{"val_loss/code": 3.2, "val_loss/prose": teacher_prose})  # fmt: skip
    w.log_eval(0, {"val_loss/code": 3.0, "val_loss/prose": 3.0,
                   "val_reverse_kl/code": 0.8, "val_reverse_kl/prose": 0.6})  # fmt: skip
    for s in range(1, 5):
        w.log_train(s, {"loss": 0.5 / s, "divergence/code": 0.6 / s, "divergence/prose": 0.4 / s,
                        "on_policy": 1.0, "tokens_processed": 800.0 * s, "completion_tokens": 32.0,
                        "grad_norm": 0.1 * s, "lr": 1e-4, "step_time": 0.5})  # fmt: skip
        if s % 2 == 0:
            w.log_eval(s, {"val_loss/code": 3.0 - 0.25 * s, "val_loss/prose": 3.0 - 0.05 * s,
                           "val_reverse_kl/code": 0.8 / s, "val_reverse_kl/prose": 0.6 / s})  # fmt: skip
    w.close()


def _rl_run(run: Path) -> None:
    w = MetricsWriter(run, is_main=True, total_steps=4, tensorboard=False, stream=io.StringIO())  # fmt: skip
    w.log_eval(0, {"val_reward": 0.125})
    for s in range(1, 5):
        w.log_train(s, {"loss": -0.01 * s, "reward": 0.1 * s, "groups_with_a_reward": 0.25 * s,
                        "clip_fraction": 0.02, "kl_mean": 0.001 * s, "ratio_mean": 1.0,
                        "completion_tokens": 64.0, "grad_norm": 0.3, "lr": 1e-5,
                        "step_time": 0.4})  # fmt: skip
        if s % 2 == 0:
            w.log_eval(s, {"val_reward": 0.125 + 0.25 * s})
    w.close()


def _draft_run(run: Path) -> None:
    """The rows `wanka draft` writes (post/draft.py's eval keys)."""
    w = MetricsWriter(run, is_main=True, total_steps=4, tensorboard=False, stream=io.StringIO())  # fmt: skip
    w.log_eval(0, {"val_mtp_kl": 0.45, "val_mtp_kl_step2": 0.9, "val_acceptance/draft1": 0.8,
                   "val_acceptance/draft2": 0.5,
                   "val_mean_acceptance_length": 2.3, "val_distinct_4grams": 0.8})  # fmt: skip
    for s in range(1, 5):
        w.log_train(s, {"loss": 1.2 / s, "mtp_kl": 0.4 / s, "mtp_kl_step2": 0.8 / s,
                        "mtp_positions": 1000.0, "tokens": 1100.0,
                        "grad_norm": 0.3, "lr": 1e-3, "step_time": 0.4})  # fmt: skip
    w.log_eval(4, {"val_mtp_kl": 0.05, "val_mtp_kl_step2": 0.125, "val_acceptance/draft1": 0.95,
                   "val_acceptance/draft2": 0.875,
                   "val_mean_acceptance_length": 2.825, "val_distinct_4grams": 0.75})  # fmt: skip
    w.close()


def _load(run: Path) -> tuple[list[dict], list[dict], list[dict]]:
    events: list[dict] = []
    train, evals = load_metrics(run, events)
    return train, evals, events


def test_gap_closed_known_numbers() -> None:
    assert gap_closed(3.0, 2.0, 2.0) == pytest.approx(1.0)
    assert gap_closed(3.0, 2.5, 2.0) == pytest.approx(0.5)
    assert gap_closed(3.0, 3.2, 2.0) == pytest.approx(-0.2)  # got worse: a negative share
    assert gap_closed(3.0, 2.8, 3.0) is None  # the teacher is no better than the start
    assert gap_closed(3.0, 2.8, 3.5) is None


def test_distill_summary_and_png(tmp_path: Path) -> None:
    run = tmp_path / "distill"
    _distill_run(run)
    train, evals, events = _load(run)
    assert is_post_run(train, evals, events) == "distill"
    lines = summarize_post(train, evals, events)
    # code: start 3.0, last 2.0, best teacher (code) 2.0 -> all of the gap closed;
    # prose: start 3.0, last 2.8, best teacher (prose) 2.5 -> 0.2 / 0.5 = 40%.
    assert lines == [
        "val_loss/code  : start 3.0000 (step 0), last 2.0000 (step 4), best teacher code 2.0000, gap closed 100.0%",
        "val_loss/prose : start 3.0000 (step 0), last 2.8000 (step 4), best teacher prose 2.5000, gap closed 40.0%",
        "val_reverse_kl/code: start 0.8000 (step 0), last 0.2000 (step 4)",
        "val_reverse_kl/prose: start 0.6000 (step 0), last 0.1500 (step 4)",
    ]  # fmt: skip

    png = plot_post_curves(run)
    assert png == run / "post_curves.png"
    data = png.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000


def test_distill_teacher_no_better_than_start_is_na(tmp_path: Path) -> None:
    run = tmp_path / "distill"
    _distill_run(run, teacher_code=3.0, teacher_prose=3.4)  # prose: best is 3.4 (code teacher 3.5)
    lines = summarize_post(*_load(run))
    assert lines[0].endswith("best teacher code 3.0000, gap closed n/a")
    assert lines[1].endswith("best teacher prose 3.4000, gap closed n/a")


@pytest.mark.parametrize(
    "kind, write, expected, out",
    [
        ("rl", _rl_run, ["val_reward     : first 0.1250 (step 0), last 1.1250 (step 4)",
                         "train reward   : last 0.4000"], "sub/rl.png"),
        ("draft", _draft_run, [
            "val_mtp_kl     : first 0.4500 (step 0), last 0.0500 (step 4)",
            "val_mtp_kl_step2: first 0.9000 (step 0), last 0.1250 (step 4)",
            "val_mean_acceptance_length: first 2.3000 (step 0), last 2.8250 (step 4)",
            "val_distinct_4grams: first 0.8000 (step 0), last 0.7500 (step 4)",
            "acceptance     : draft1 95.0%, draft2 87.5% (last eval)",
        ], None),
    ],
)  # fmt: skip
def test_rl_and_draft_summary_and_png(tmp_path: Path, kind, write, expected, out) -> None:
    run = tmp_path / kind
    write(run)
    train, evals, events = _load(run)
    assert is_post_run(train, evals, events) == kind
    assert summarize_post(train, evals, events) == expected
    png = plot_post_curves(run, out=tmp_path / out if out else None)
    assert png == (tmp_path / out if out else run / "post_curves.png")
    data = png.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000


def test_report_main_draws_post_curves_only_for_post_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    post = tmp_path / "distill"
    _distill_run(post)
    assert report_main(str(post)) == 0
    out = capsys.readouterr().out
    assert (post / "loss_curve.png").read_bytes()[:8] == PNG  # the pre-training panels still draw
    assert (post / "post_curves.png").read_bytes()[:8] == PNG
    assert "gap closed 100.0%" in out and "post curves" in out

    pre = tmp_path / "pretrain"
    pre.mkdir()
    rows = [{"kind": "train", "step": s, "time": float(s), "loss": 4.0 - 0.1 * s, "lm_loss": 4.0,
             "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0} for s in range(1, 5)]  # fmt: skip
    rows.append({"kind": "eval", "step": 4, "time": 4.5, "val_loss": 3.5})
    rows.append({"kind": "resume", "step": 2, "time": 2.5})
    (pre / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert is_post_run(*_load(pre)) is None
    assert report_main(str(pre)) == 0
    out = capsys.readouterr().out
    assert (pre / "loss_curve.png").is_file()
    assert not (pre / "post_curves.png").exists() and "post curves" not in out
    with pytest.raises(ValueError, match="not a wanka distill / rl / draft run"):
        plot_post_curves(pre)
