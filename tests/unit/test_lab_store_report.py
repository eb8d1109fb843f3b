"""History store (resumable runs), report (leaderboard, fast_p, PNG) and export of the best
candidate as an op-registry backend."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from wanka.lab.evaluator import EvalConfig
from wanka.lab.proposers.search import SearchProposer
from wanka.lab.report import export, fast_p, format_report, report
from wanka.lab.runner import RunConfig, run_task
from wanka.lab.store import Store
from wanka.lab.task import LabError, Shape
from wanka.lab.tasks import get_task
from wanka.ops import registry

EVAL = EvalConfig(repeats=3)


def small(name: str):
    t = get_task(name)
    return dataclasses.replace(
        t, shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 512, "D": 256}),
        held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 300, "D": 200}),
    )  # fmt: skip


class Interrupting(SearchProposer):
    """Dies (like a killed process) after `n` proposals."""

    def __init__(self, n: int):
        super().__init__(seed=0)
        self.left = n

    def propose(self, task, history):
        if self.left == 0:
            raise KeyboardInterrupt
        self.left -= 1
        return super().propose(task, history)


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    db = tmp_path_factory.mktemp("lab") / "h.sqlite"
    task = small("rmsnorm-cpu")
    with pytest.raises(KeyboardInterrupt):
        run_task(
            task, Interrupting(2), Store(db), RunConfig(budget=4, eval=EVAL), log=lambda s: None
        )
    return db, task


def test_interrupted_run_resumes_where_it_stopped(history):
    db, task = history
    store = Store(db)
    (run,) = store.runs()
    assert run.finished is None and len(store.candidates(run.id)) == 2
    logs = []
    out = run_task(
        task, SearchProposer(seed=0), store, RunConfig(budget=4, eval=EVAL), log=logs.append
    )
    assert out["run_id"] == run.id and out["evaluations"] == 4
    assert logs[0].startswith(f"resuming run {run.id}: 2 of 4")
    hist = store.candidates(run.id)
    assert [r.n for r in hist] == [1, 2, 3, 4]
    assert len({str(r.config) for r in hist}) == 4  # nothing re-evaluated
    rec = hist[0]
    assert rec.source and rec.feedback.status == rec.status and rec.time_s and rec.baseline_s
    assert store.run(run.id).finished is not None
    # a finished run is not resumed: the next run is a new one
    out2 = run_task(
        task, SearchProposer(seed=1), store, RunConfig(budget=1, eval=EVAL), log=lambda s: None
    )
    assert out2["run_id"] != run.id


def test_report_leaderboard_fast_p_and_png(history, tmp_path):
    db, _ = history
    rep = report(Store(db), png=tmp_path / "curve.png")
    (row,) = rep["leaderboard"]
    assert row["task"] == "rmsnorm-cpu" and row["evaluations"] >= 4 and row["best_speedup"] > 0
    assert set(rep["fast_p"]) == {"fast_0", "fast_1", "fast_1.5", "fast_2", "fast_3"}
    # KernelBench's denominator: every task runnable here, the ones without runs are misses
    assert "rope-cpu" in rep["suite"] and "rmsnorm-cpu" in rep["suite"]
    assert rep["fast_p"]["fast_0"] == pytest.approx(1 / len(rep["suite"]))
    only = report(Store(db), tasks=["rmsnorm-cpu"])
    assert only["fast_p"]["fast_0"] == 1.0  # one task, verified on held-out shapes
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    curve = rep["runs"][0]["best_so_far"]
    assert curve == sorted(curve)  # best-so-far never decreases
    text = format_report(rep)
    assert "rmsnorm-cpu" in text and "fast_p" in text


def test_fast_p_definition():
    class R:  # minimal stand-in for a verified record
        def __init__(self, s):
            self.speedup, self.held_out_speedup, self.held_out_ok = s, s, True

    rows = {"a": {"verified": R(2.5)}, "b": {"verified": R(1.2)}, "c": {"verified": None}}
    f = fast_p(rows, tasks=["a", "b", "c"])
    assert f["fast_0"] == pytest.approx(2 / 3) and f["fast_2"] == pytest.approx(1 / 3)
    assert f["fast_3"] == 0.0
    # a task of the suite with no run at all is a miss, not left out of the denominator
    f = fast_p(rows, tasks=["a", "b", "c", "d"])
    assert f["fast_0"] == pytest.approx(2 / 4) and f["fast_2"] == pytest.approx(1 / 4)
    assert fast_p(rows)["fast_0"] <= 2 / 3  # default suite: registered tasks plus rows


def test_export_registers_a_working_backend(history, tmp_path, monkeypatch):
    db, task = history
    path = export(Store(db), "rmsnorm-cpu", tmp_path / "lab_rmsnorm.py", backend="labtest",
                  eval_cfg=EVAL, task=task)  # fmt: skip
    spec = importlib.util.spec_from_file_location("lab_rmsnorm_export", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "labtest" in registry.backends("rms_norm")
    monkeypatch.setenv("WANKA_OPS_BACKEND", "rms_norm=labtest")
    x, w = torch.randn(9, 64), torch.rand(64)
    got = registry.call("rms_norm", x, w, 1e-6)
    ref = task.reference_fn()(x, w, 1e-6)
    torch.testing.assert_close(got, ref)
    with pytest.raises(LabError, match="no held-out-verified"):
        export(Store(db), "rope-cpu", tmp_path / "x.py")
