"""`wanka bench post`'s summary, from hand-written metrics files: equal compute is read in
tokens processed, gap closure against the best teacher per domain, SFT's compute to reach
MOPD's loss, RL's spread over seeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wanka.bench.post import (
    PostBenchPlan,
    at_tokens,
    check_plan,
    mopd_runs,
    summarize,
    table,
    tokens_to_reach,
)


def _write(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _student(run: Path, losses: list[tuple[float, float]], per_step: float, every: int = 10,
             rkl: list[tuple[float, float]] | None = None):  # fmt: skip
    """Evals every `every` steps with (code, prose) losses (and held-out reverse KLs);
    each step processes per_step."""
    rows = []
    for i, (code, prose) in enumerate(losses):
        step = i * every
        if step:
            rows += [{"kind": "train", "step": s, "tokens_processed": per_step}
                     for s in range(step - every + 1, step + 1)]  # fmt: skip
        rows.append({"kind": "eval", "step": step, "val_loss/code": code, "val_loss/prose": prose})
        if rkl:
            rows[-1].update({"val_reverse_kl/code": rkl[i][0], "val_reverse_kl/prose": rkl[i][1]})
    _write(run, rows)


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    start = (3.0, 4.0)
    _student(tmp_path / "mopd", [start, (2.5, 3.5), (2.2, 3.1)], per_step=100,
             rkl=[(0.5, 0.6), (0.3, 0.4), (0.2, 0.1)])  # fmt: skip
    rows = (tmp_path / "mopd" / "metrics.jsonl").read_text()
    teacher_eval = [{"kind": "teacher_eval", "step": 0, "teacher": "code", "val_loss/code": 2.0,
                     "val_loss/prose": 3.9},
                    {"kind": "teacher_eval", "step": 0, "teacher": "prose", "val_loss/code": 2.9,
                     "val_loss/prose": 3.0}]  # fmt: skip
    (tmp_path / "mopd" / "metrics.jsonl").write_text(
        rows + "".join(json.dumps(r) + "\n" for r in teacher_eval)
    )
    _student(tmp_path / "single_code", [start, (2.4, 3.9), (2.1, 3.9)], per_step=100)
    # SFT: cheaper steps (no teacher forward), run 4x as long; reaches MOPD's mean late.
    _student(tmp_path / "sft_teacher_samples",
             [start, (2.9, 3.9), (2.8, 3.8), (2.7, 3.6), (2.6, 3.4), (2.4, 3.2), (2.3, 3.0)],
             per_step=60)  # fmt: skip
    for seed, (a, b) in enumerate([(0.1, 0.5), (0.1, 0.6), (0.2, 0.7)]):
        _write(tmp_path / f"rl-seed{seed}", [{"kind": "eval", "step": 0, "val_reward": a},
                                            {"kind": "eval", "step": 80, "val_reward": b}])  # fmt: skip
    return tmp_path


def test_summary_reads_equal_compute_gap_and_compute_to_target(bench):
    s = summarize(bench, PostBenchPlan(rl_seeds=3))
    assert s["best_teacher"] == {"code": 2.0, "prose": 3.0}
    mopd = s["runs"]["mopd"]
    assert mopd["tokens_processed"] == 2000 and mopd["final"]["step"] == 20
    assert mopd["gap_closed"]["code"] == pytest.approx(0.8) and mopd["gap_closed"][
        "prose"
    ] == pytest.approx(0.9)
    single = s["runs"]["single_code"]["gap_closed"]
    assert single["code"] == pytest.approx(0.9) and single["prose"] == pytest.approx(0.1)
    sft = s["runs"]["sft_teacher_samples"]
    # Equal compute: interpolated at MOPD's 2000 tokens, a third of the way from step 30
    # (1800 tokens) to step 40 (2400).
    assert sft["tokens_processed"] == 2000 and sft["reached_equal_compute"]
    assert sft["val_loss"]["code"] == pytest.approx(2.7 - 0.1 / 3)
    assert sft["val_loss"]["prose"] == pytest.approx(3.6 - 0.2 / 3)
    assert sft["final"] == {"step": 60, "tokens_processed": 3600, "code": 2.3, "prose": 3.0}
    c = s["compute_to_mopd_loss"]
    assert c["target_mean_val_loss"] == pytest.approx(2.65)
    assert c["tokens"]["mopd"] == 2000 and c["tokens"]["sft_teacher_samples"] == 3600
    assert c["sft_over_mopd"] == pytest.approx(1.8)
    assert s["rl"]["start"] == pytest.approx(0.4 / 3) and s["rl"]["final_mean"] == pytest.approx(
        0.6
    )
    assert s["rl"]["final_std"] == pytest.approx(0.1)
    assert mopd["reverse_kl"] == pytest.approx(
        {"code": 0.2, "prose": 0.1}
    )  # equal compute: its end
    assert "reverse_kl" not in sft  # SFT logs no teacher divergence
    text = "\n".join(table(s))
    assert (
        "mopd: held-out KL(student || teacher) on its own samples: code 0.2000, prose 0.1000"
        in text
    )
    assert "| mopd | 2000 | 2.2000 | 80.0% | 3.1000 | 90.0% | 20 |" in text and "1.80x" in text


def test_a_run_that_never_reaches_the_target_says_so():
    points = [{"step": 0, "tokens": 0, "code": 3.0, "prose": 4.0},
              {"step": 10, "tokens": 500, "code": 2.9, "prose": 3.9}]  # fmt: skip
    assert tokens_to_reach(points, ["code", "prose"], 3.0) is None
    assert tokens_to_reach(points, ["code", "prose"], 3.4) == 500


def test_a_run_that_stops_before_equal_compute_is_flagged(tmp_path):
    points = [{"step": 0, "tokens": 0, "code": 3.0}, {"step": 10, "tokens": 500, "code": 2.0}]
    assert at_tokens(points, 250, ["code"]) == {"code": 2.5}
    assert at_tokens(points, 500, ["code"]) == {"code": 2.0}
    assert at_tokens(points, 501, ["code"]) is None


def test_each_mopd_divergence_is_measured_against_sft_at_its_own_loss(bench):
    # Forward KL on the student's own samples: below MOPD's curve; its mean loss at equal
    # compute (2.5) is below SFT's best (2.65), so SFT never reaches it.
    _student(bench / "mopd_forward_kl", [(3.0, 4.0), (2.4, 3.3), (2.1, 2.9)], per_step=100)
    s = summarize(bench, PostBenchPlan(rl_seeds=0))
    fkl = s["runs"]["mopd_forward_kl"]
    assert fkl["gap_closed"]["code"] == pytest.approx(0.9)
    assert fkl["gap_closed"]["prose"] == pytest.approx(1.1)
    c = s["compute_to_loss"]["mopd_forward_kl"]
    assert c["target_mean_val_loss"] == pytest.approx(2.5) and c["tokens"]["mopd"] is None
    assert c["tokens"]["sft_teacher_samples"] is None  # SFT's best mean is 2.65: never there
    assert c["sft_over_run"] is None
    # The forward-KL run reached 2.5 at 2000 tokens; SFT spent 3600 without getting there.
    assert c["tokens"]["mopd_forward_kl"] == 2000
    assert c["sft_over_run_at_least"] == pytest.approx(1.8)
    assert s["compute_to_loss"]["mopd"]["sft_over_run"] == pytest.approx(1.8)
    assert "sft_over_run_at_least" not in s["compute_to_loss"]["mopd"]
    assert s["compute_to_mopd_loss"]["sft_over_mopd"] == pytest.approx(1.8)
    assert s["rl"] is None  # --rl-seeds 0: no RL phase, none read
    text = "\n".join(table(s))
    assert "rl: not run" in text and "SFT / mopd = 1.80x" in text
    assert "compute to reach mopd_forward_kl's mean held-out loss 2.5000" in text
    assert "SFT / mopd_forward_kl > 1.80x (SFT stopped first)" in text
    # A plan without the forward-KL run ignores the directory another plan left behind.
    only = summarize(bench, PostBenchPlan(rl_seeds=0, mopd_divergences="reverse_kl"))
    assert "mopd_forward_kl" not in only["runs"] and set(only["compute_to_loss"]) == {"mopd"}


def test_mopd_divergences_name_the_runs_and_reverse_kl_is_required():
    assert mopd_runs(PostBenchPlan()) == {"mopd": "reverse_kl", "mopd_forward_kl": "forward_kl"}
    assert mopd_runs(PostBenchPlan(mopd_divergences="reverse_kl")) == {"mopd": "reverse_kl"}
    for bad in ("forward_kl", "reverse_kl,jsd", ""):
        with pytest.raises(ValueError, match="--mopd-divergences"):
            check_plan(PostBenchPlan(mopd_divergences=bad))
    check_plan(PostBenchPlan(rl_seeds=0))  # 0 seeds: no RL, allowed
    with pytest.raises(ValueError, match="--rl-seeds=-1"):
        check_plan(PostBenchPlan(rl_seeds=-1))


@pytest.mark.parametrize("field", ["student_steps", "prompts_per_step", "sft_factor"])
def test_a_plan_with_nothing_to_run_is_refused_up_front(field):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}=0"):
        check_plan(PostBenchPlan(**{field: 0}))
    with pytest.raises(ValueError, match="single-teachers"):
        check_plan(PostBenchPlan(single_teachers="code,math"))
    with pytest.raises(ValueError, match="--rl-reward: reward 'python_parse'"):
        check_plan(PostBenchPlan(rl_reward="python_parse"))
    check_plan(PostBenchPlan(rl_reward="python_parses"))


def test_phases_are_reused_across_bench_directories_but_never_mixed(tmp_path, monkeypatch):
    import wanka.bench.post as bp

    ran = []

    def fake_wanka(*args, log):
        ran.append(args)
        run = Path(next(a for a in args if a.startswith("run.dir=")).split("=", 1)[1])
        (run / "checkpoints" / "step-00000002").mkdir(parents=True)

    monkeypatch.setattr(bp, "_wanka", fake_wanka)

    def args(out: Path, steps: int = 2) -> list[str]:
        return ["sft", "cfg.toml", "--set", f"run.dir={out}/t", "--set", f"post.init={out}/base",
                "--set", f"train.steps={steps}"]  # fmt: skip

    a, b = tmp_path / "a", tmp_path / "b"
    bp._phase(a / "t", 2, args(a), tmp_path / "log")
    bp._phase(a / "t", 2, args(a), tmp_path / "log")  # finished, same inputs: reused
    assert len(ran) == 1
    shutil.copytree(a / "t", b / "t")  # another bench with the same plan shares the phase
    bp._phase(b / "t", 2, args(b), tmp_path / "log")
    assert len(ran) == 1
    with pytest.raises(ValueError, match="other inputs"):
        bp._phase(b / "t", 3, args(b, steps=3), tmp_path / "log")
