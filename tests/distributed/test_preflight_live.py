"""Live pre-flight on 2 real local gloo ranks: a healthy pair passes every check; a rank slowed
by fault injection is named by the burn-in check."""

from __future__ import annotations

import time

from wanka.config import load_config
from wanka.resilience import preflight as pf


def test_live_checks_pass_on_two_ranks(job_args):
    cfg = load_config(None, job_args("run"))
    t0 = time.perf_counter()
    results = pf.live_checks(cfg, nproc=2, timeout_s=30)
    took = time.perf_counter() - t0
    by = {r.name: r for r in results}
    assert all(r.ok for r in results), "\n".join(f"{r.name}: {r.message}" for r in results)
    assert set(by) == {"backend.init", "link.intra_node", "compute.burn_in", "memory.free"}
    assert "1 pair(s)" in by["link.intra_node"].message and "GB/s" in by["link.intra_node"].message
    assert "GFLOP/s" in by["compute.burn_in"].message
    assert took < 30, f"live checks took {took:.1f}s"


def test_slow_rank_is_flagged(job_args, monkeypatch):
    monkeypatch.setenv(pf.SLOW_RANK_ENV, "1")  # the ranks inherit it; only rank 1 sleeps
    monkeypatch.setenv(pf.SLOW_FACTOR_ENV, "0.2")
    cfg = load_config(None, job_args("run"))
    report = pf.preflight(cfg, nproc=2, live=True)
    burn = {r.name: r for r in report.results}["compute.burn_in"]
    assert not report.ok and not burn.ok, report.format()
    assert "rank 1 (node 0)" in burn.message and "rank 0" not in burn.message
    assert "FAIL  compute.burn_in" in report.format()
