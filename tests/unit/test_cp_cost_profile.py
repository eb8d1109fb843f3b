"""The cost model's position profile: a per-token cost by position bin, fitted non-decreasing,
used by the dynamic planner and by `wanka bench cp`'s fit where it explains the timings better
than the three terms (the CPU kernel's cost per token climbs to ~1.5 x topk, then is flat)."""

from __future__ import annotations

import dataclasses
import json
from itertools import combinations

import numpy as np
import pytest

from wanka.bench.cp_report import fit_cost
from wanka.distributed.cp_cost import CostModel, load_cost, nnls
from wanka.distributed.cp_plan import plan_step

# Shaped like the 8k replay's fit (ms per token by 1024 positions: 0.83, 1.07, 1.64, 2.87...).
MEASURED = CostModel(linear=0.0, sparse=0.0, dense=0.0, topk=2048,
                     profile=(0.83e-3, 1.07e-3, 1.64e-3, 2.87e-3), profile_bin=1024)  # fmt: skip


def per_position(model: CostModel, s: int, e: int) -> float:
    """The definition, position by position."""
    total = 0.0
    for p in range(s, e):
        j = min(p // model.profile_bin, len(model.profile) - 1)
        total += model.profile[j] + model.linear + model.sparse * min(p + 1, model.topk)
        total += model.dense * (p + 1)
    return total


def test_profile_cost_is_the_sum_over_positions_and_holds_past_the_last_bin():
    m = dataclasses.replace(MEASURED, linear=1e-5, sparse=1e-8, dense=1e-9)
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = int(rng.integers(0, 9000))
        e = s + int(rng.integers(0, 3000))
        want = per_position(m, s, e)
        assert float(m.cost(s, e)) == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert m.piece_cost(s, e) == pytest.approx(want, rel=1e-9, abs=1e-15)
    starts = rng.integers(0, 9000, 50)
    ends = starts + rng.integers(0, 3000, 50)
    np.testing.assert_allclose(m.cost(starts, ends),
                               [per_position(m, a, b) for a, b in zip(starts, ends)], rtol=1e-9)  # fmt: skip
    assert float(m.doc_cost(10_000)) == pytest.approx(per_position(m, 0, 10_000), rel=1e-9)


@pytest.mark.parametrize("bad", [
    {"profile": (1e-3,), "profile_bin": 0},
    {"profile": (1e-3,), "profile_bin": 2.5},
    {"profile": (1e-3, float("nan")), "profile_bin": 8},
    {"profile": (1e-3, -1e-3), "profile_bin": 8},
    {"profile": (1e40,), "profile_bin": 8},
    {"profile": (0.0, 0.0), "profile_bin": 8},
    {"profile": (0.0, 1e-6), "profile_bin": 512},  # the first bin free: the plan divided by 0
    {"profile": (3e-6, 1e-6), "profile_bin": 512},  # falling with position
    {"profile": "123", "profile_bin": 8},  # a string from a JSON file
    {"profile": {"1": 2.0}, "profile_bin": 8},
    {"profile": (True, True), "profile_bin": 8},
    {"profile": ("1e-6",), "profile_bin": 8},
    {"profile": (), "profile_bin": 512},  # a bin size without a profile
    {"profile": (), "profile_bin": "x"},
])  # fmt: skip
def test_a_bad_profile_is_refused(bad):
    with pytest.raises(ValueError, match="cost model"):
        CostModel(linear=0.0, sparse=0.0, dense=0.0, **bad)


def test_a_profile_survives_the_json_round_trip(tmp_path):
    path = tmp_path / "cp.json"
    path.write_text(json.dumps({"cost_model": dataclasses.asdict(MEASURED)}))
    assert load_cost(path) == MEASURED


def test_nnls_is_the_best_non_negative_fit():
    rng = np.random.default_rng(1)
    for _ in range(100):
        a, b = rng.normal(size=(10, 5)) * rng.choice([1.0, 1e4, 1e-4], 5), rng.normal(size=10)
        x = nnls(a, b)
        best = min(
            float(np.sum((a @ z - b) ** 2))
            for k in range(6) for cols in combinations(range(5), k)
            if (z := _lstsq_on(a, b, cols)) is not None
        )  # fmt: skip
        assert (x >= 0).all() and float(np.sum((a @ x - b) ** 2)) <= best * (1 + 1e-7) + 1e-12


def _lstsq_on(a, b, cols):
    z = np.zeros(a.shape[1])
    if cols:
        z[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
    return None if (z < 0).any() else z


def _samples(truth: CostModel, n: int, seed: int, noise: float = 0.0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pieces = []
        for _ in range(int(rng.integers(1, 4))):
            s = int(rng.integers(0, 4000))
            pieces.append((s, s + int(rng.integers(1, 2000))))
        t = sum(truth.piece_cost(a, e) for a, e in pieces) * (1 + noise * rng.normal())
        out.append((pieces, t))
    return out


def test_fit_profile_recovers_a_rising_then_flat_cost_and_never_falls():
    truth = dataclasses.replace(MEASURED, profile_bin=512,
                                profile=(1e-3, 1e-3, 2e-3, 3e-3, 3e-3, 3e-3, 3e-3, 3e-3))  # fmt: skip
    fitted = CostModel.fit_profile(_samples(truth, 80, 0), 512)
    assert fitted.profile_bin == 512 and len(fitted.profile) >= 8
    np.testing.assert_allclose(fitted.profile[:8], truth.profile, rtol=1e-6)
    noisy = CostModel.fit_profile(_samples(truth, 80, 1, noise=0.05), 512)
    assert all(b >= a for a, b in zip(noisy.profile, noisy.profile[1:]))


def test_bench_fit_keeps_the_form_that_explains_the_timings():
    def records(truth, seed):
        return [{"compute_s": t, "pieces": [list(p) for p in pieces],
                 "terms": [int(x.sum()) for x in truth.terms(*np.array(pieces).T)]}
                for pieces, t in _samples(truth, 60, seed)]  # fmt: skip

    stepped = dataclasses.replace(MEASURED, profile_bin=512)
    model, fit = fit_cost(records(stepped, 2), 2048)
    assert fit["form"] == "profile" and fit["mean_rel_error"] < 0.01
    assert fit["mean_rel_error_terms"] > fit["mean_rel_error_profile"]
    three = CostModel(linear=1e-4, sparse=1e-6, dense=1e-8, topk=512)
    model, fit = fit_cost(records(three, 3), 512)
    assert fit["form"] == "terms" and fit["mean_rel_error"] < 1e-6
    assert model.linear == pytest.approx(1e-4, rel=1e-6)
    # records without their pieces (older runs): the three terms only
    bare = [{k: v for k, v in r.items() if k != "pieces"} for r in records(stepped, 4)]
    assert fit_cost(bare, 2048)[1]["form"] == "terms"


def test_the_planner_balances_by_the_profile():
    """An 8k document over 4 ranks at a mean + 10% token budget, under the measured profile:
    its first ~3k positions cost a third to a half of the rest per token."""
    rows = [[[8192]]]
    head_tail = plan_step(rows, 4, "head_tail", MEASURED).imbalance(MEASURED)
    plan = plan_step(rows, 4, "dynamic", MEASURED)
    assert plan.tokens_per_rank().max() <= 2253
    assert head_tail > 1.1 and plan.imbalance(MEASURED) < 1.01


def test_a_free_first_bin_from_a_hand_made_file_never_reaches_the_planner(tmp_path):
    """(0, x) profiles made the planner divide by a zero cost: OverflowError at even cp, an
    endless loop at odd cp. Refused at load; a fit never produces one."""
    path = tmp_path / "cp.json"
    path.write_text(json.dumps({"cost_model": {"linear": 0, "sparse": 0, "dense": 0,
                                               "topk": 2048, "profile": [0.0, 1e-6],
                                               "profile_bin": 512}}))  # fmt: skip
    with pytest.raises(ValueError, match="no cost"):
        load_cost(path)
    flat_start = [([(0, 300)], 1e-9), ([(0, 2000)], 1.0), ([(1000, 3000)], 2.0)]
    assert CostModel.fit_profile(flat_start, 512).profile[0] > 0
    cost = CostModel.fit_profile(flat_start, 512)
    for cp in (2, 3, 4, 5):
        lengths = [[[400] * cp + [300]]]
        plan = plan_step(lengths, cp, "dynamic", cost)
        assert plan.tokens_per_rank().sum() == 400 * cp + 300


def test_fit_profile_keeps_whole_bins_and_refuses_a_huge_table_up_front():
    truth = dataclasses.replace(MEASURED, profile_bin=512)
    samples = _samples(truth, 200, 5) + [([(0, 8193)], truth.piece_cost(0, 8193) * 1.05)]
    fitted = CostModel.fit_profile(samples, 512)
    assert len(fitted.profile) == 16  # 8193 // 512: the one-token sliver is not a bin
    assert float(fitted.doc_cost(32768)) < 1.2 * float(truth.doc_cost(32768))
    with pytest.raises(ValueError, match="at most 4096"):
        CostModel.fit_profile([([(0, 50_000_000)], 1.0)], 512)


def test_numpy_bin_sizes_are_plain_ints_for_json():
    m = CostModel(linear=0.0, sparse=0.0, dense=0.0, profile=(np.float64(1e-6),),
                  profile_bin=np.int64(512))  # fmt: skip
    assert json.loads(json.dumps(dataclasses.asdict(m)))["profile_bin"] == 512


def test_bench_fit_prefers_the_terms_when_the_profile_only_fits_its_own_samples():
    """A three-term kernel, 16 noisy calibration records (what a bench calibration has): the
    profile's many bins fit their own samples better but the held-out halves decide."""
    three = CostModel(linear=1e-4, sparse=1e-6, dense=1e-8, topk=2048)
    chosen = []
    for seed in range(6):
        recs = [{"compute_s": t, "pieces": [list(p) for p in pieces],
                 "terms": [int(x.sum()) for x in three.terms(*np.array(pieces).T)]}
                for pieces, t in _samples(three, 16, 100 + seed, noise=0.05)]  # fmt: skip
        model, fit = fit_cost(recs, 2048)
        chosen.append(fit["form"])
        if "held_out_error" in fit:
            assert (fit["form"] == "profile") == (
                fit["held_out_error"]["profile"] < fit["held_out_error"]["terms"]
            )
    assert chosen.count("terms") >= 4, chosen
