"""The search proposer: seeded with the baseline, never repeats a point, learns from
failures, respects the budget, and improves on a real (small) task."""

from __future__ import annotations

import dataclasses
import json
import math

from wanka.lab.evaluator import EvalConfig, Feedback
from wanka.lab.proposers.search import SearchProposer
from wanka.lab.runner import RunConfig, run_task
from wanka.lab.store import Record, Store
from wanka.lab.task import Knob, Shape, VariantSpace
from wanka.lab.tasks import get_task

TEMPLATE = 'CONFIG = {"a": 0, "b": "x"}\ndef kernel(x):\n    return x\n'
SPACE = VariantSpace(TEMPLATE, (Knob("a", (0, 1, 2, 3), ordered=True), Knob("b", ("x", "y"))),
                     baseline={"a": 0, "b": "x"})  # fmt: skip


def fake_task():
    return dataclasses.replace(get_task("rmsnorm-cpu"), space=SPACE)


def record(n: int, cfg: dict, speedup: float | None) -> Record:
    ok = speedup is not None
    fb = Feedback("correct" if ok else "incorrect", time_s=1.0 if ok else None,
                  baseline_s=speedup if ok else None)  # fmt: skip
    return Record(n, 1, n, 0.0, "", cfg, "", fb.status, ok, fb.time_s, fb.baseline_s,
                  fb.baseline_s, fb.speedup, fb, None, None)  # fmt: skip


def test_first_proposal_is_the_baseline_and_points_never_repeat():
    p, task, hist = SearchProposer(seed=1), fake_task(), []
    for i in range(8):  # the space has 8 points
        prop = p.propose(task, hist)
        assert prop is not None
        if i == 0:
            assert prop.config == {"a": 0, "b": "x"} and "baseline" in prop.note
        assert f"CONFIG = {prop.config!r}" in prop.source
        hist.append(record(i + 1, prop.config, 1.0 + prop.config["a"]))
    assert len({json.dumps(r.config, sort_keys=True) for r in hist}) == 8
    assert p.propose(task, hist) is None  # exhausted


def test_irrelevant_knobs_are_canonicalised():
    space = get_task("sparse_attention-cpu").space
    a = space.canonical(dict(space.baseline, chunk=64, divisor=3.0))  # gather_full: no chunks
    assert a == space.canonical(space.baseline)
    assert space.size() < math.prod(len(k.values) for k in space.knobs)


def test_mutations_follow_the_fast_candidates_and_avoid_failing_values():
    space = VariantSpace(TEMPLATE, (Knob("a", tuple(range(12)), ordered=True),
                                    Knob("b", ("x", "y", "z"))), baseline={"a": 0, "b": "x"})  # fmt: skip
    task = dataclasses.replace(get_task("rmsnorm-cpu"), space=space)
    hist = [record(1, {"a": 0, "b": "x"}, 1.0), record(2, {"a": 6, "b": "y"}, 4.0)]
    hist += [record(3 + i, {"a": i, "b": "z"}, None) for i in range(1, 6)]  # z always fails
    props = []
    for s in range(40):
        prop = SearchProposer(seed=s, explore=0.0).propose(task, hist)
        props.append(prop.config)
    near_best = sum(abs(c["a"] - 6) <= 2 for c in props)
    assert near_best >= 25  # local search around the 4x candidate
    assert sum(c["b"] == "z" for c in props) <= 8  # the failing value is rarely retried


def test_search_run_on_a_real_task_within_budget(tmp_path):
    t = get_task("rmsnorm-cpu")
    task = dataclasses.replace(
        t, shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 1024, "D": 512}),
        held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 600, "D": 384}),
    )  # fmt: skip
    store = Store(tmp_path / "h.sqlite")
    cfg = RunConfig(budget=5, eval=EvalConfig(repeats=3))
    out = run_task(task, SearchProposer(seed=0), store, cfg, log=lambda s: None)
    hist = store.candidates(out["run_id"])
    assert len(hist) == 5 and out["evaluations"] == 5
    assert hist[0].config == task.space.canonical(task.space.baseline)
    assert all(r.correct for r in hist)  # every rmsnorm variant is exact
    assert out["best"]["speedup"] > 0 and out["verified"] is not None
    assert store.candidate(out["verified"]["candidate"]).held_out_ok
