"""Fault ledger (SQLite), eviction policy and `wanka nodes`."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wanka.resilience.ledger import NODE_CAUSES, EvictionPolicy, FaultLedger
from wanka.resilience.nodes_cli import DEFAULT_LEDGER, add_nodes_parser

T = 1_000_000.0  # a fixed "now" so the window arithmetic is exact


def test_record_and_query(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "faults.sqlite"
    led = FaultLedger(path)
    assert path.is_file()
    f = led.record("job1", "n1", 3, "hang", step=7, detail="rank 3 stuck in all_reduce", time=T)
    assert f.id > 0 and f.time == T and f.rank == 3 and f.step == 7
    led.record("job1", "n2", None, "node_down", time=T + 1)
    led.record("job2", "n1", 0, "nan", time=T + 2)

    # A second instance (another process's view) sees the same rows.
    led2 = FaultLedger(path)
    assert [x.cause for x in led2.faults()] == ["hang", "node_down", "nan"]
    assert [x.cause for x in led2.faults(node="n1")] == ["hang", "nan"]
    assert [x.node for x in led2.faults(since=T + 1)] == ["n2", "n1"]
    got = led2.faults(node="n1")[0]
    assert (got.job, got.rank, got.step, got.detail) == ("job1", 3, 7, "rank 3 stuck in all_reduce")
    assert led2.faults(node="n2")[0].rank is None

    with pytest.raises(ValueError, match="unknown fault cause 'hnag'"):
        led.record("job1", "n1", 0, "hnag")


def test_policy_any_cause_window(tmp_path: Path) -> None:
    led = FaultLedger(tmp_path / "l.sqlite")
    pol = EvictionPolicy(max_faults=3, window_s=100.0, same_cause=2)
    # Three different non-node causes: only the any-cause rule can fire.
    led.record("j", "n1", 0, "nan", time=T - 150)  # outside the window
    led.record("j", "n1", 0, "process_crash", time=T - 50)
    led.record("j", "n1", 0, "nan", time=T - 10)
    assert led.evaluate("n1", pol, now=T) is None  # 2 in window
    led.record("j", "n1", 1, "preempted", time=T - 5)
    reason = led.evaluate("n1", pol, now=T)
    assert reason is not None and reason.startswith("3 faults within 100 s")
    # Later, the old ones slide out of the window.
    assert led.evaluate("n1", pol, now=T + 60) is None
    # Faults in the future of `now` do not count either.
    assert led.evaluate("n1", pol, now=T - 40) is None
    # Other nodes are unaffected.
    assert led.evaluate("n2", pol, now=T) is None


def test_same_cause_rule_only_for_node_causes(tmp_path: Path) -> None:
    led = FaultLedger(tmp_path / "l.sqlite")
    pol = EvictionPolicy(max_faults=10, window_s=100.0, same_cause=2)
    led.record("j", "n1", 0, "nan", time=T - 20)
    led.record("j", "n1", 0, "nan", time=T - 10)
    assert led.evaluate("n1", pol, now=T) is None  # NaN twice is the job's fault, not the node's
    led.record("j", "n2", 0, "hang", time=T - 200)  # outside the window
    led.record("j", "n2", 0, "hang", time=T - 20)
    led.record("j", "n2", 0, "slow", time=T - 10)
    assert led.evaluate("n2", pol, now=T) is None  # one hang + one slow in the window
    led.record("j", "n2", 1, "slow", time=T - 5)
    assert led.evaluate("n2", pol, now=T) == "2 x slow within 100 s"
    assert {"hang", "slow", "node_down", "node_lost", "startup_failure", "link"} == NODE_CAUSES
    # 0 disables a rule.
    assert led.evaluate("n2", EvictionPolicy(max_faults=0, window_s=100, same_cause=0), T) is None


def test_evict_and_clear(tmp_path: Path) -> None:
    led = FaultLedger(tmp_path / "l.sqlite")
    pol = EvictionPolicy(max_faults=5, window_s=1e6, same_cause=2)
    led.record("j", "n1", 0, "startup_failure", time=T - 2)
    led.record("j", "n1", 0, "startup_failure", time=T - 1)
    reason = led.evaluate("n1", pol, now=T)
    assert reason == "2 x startup_failure within 1e+06 s"
    led.evict("n1", reason)
    led.evict("n3", "bad DIMM")  # operator eviction of a node with no faults
    assert led.evicted() == {"n1": reason, "n3": "bad DIMM"}

    led.clear("n1")
    assert led.evicted() == {"n3": "bad DIMM"}
    assert led.evaluate("n1", pol, now=T) is None  # old faults no longer count ...
    assert len(led.faults(node="n1")) == 2  # ... but stay in the history
    # A fault recorded after the clear counts, even one stamped earlier (clock skew).
    led.record("j", "n1", 0, "startup_failure", time=T - 3)
    assert led.evaluate("n1", pol, now=T) is None
    led.record("j", "n1", 0, "startup_failure", time=T)
    assert led.evaluate("n1", pol, now=T) is not None

    by_node = {s["node"]: s for s in led.summary()}
    assert set(by_node) == {"n1", "n3"}
    assert by_node["n1"]["status"] == "ok" and by_node["n1"]["faults"] == 4
    assert by_node["n1"]["counted"] == 2 and by_node["n1"]["by_cause"] == {"startup_failure": 4}
    assert by_node["n1"]["last_cause"] == "startup_failure" and by_node["n1"]["last_time"] == T
    assert by_node["n3"]["status"] == "evicted" and by_node["n3"]["reason"] == "bad DIMM"
    assert by_node["n3"]["faults"] == 0 and by_node["n3"]["last_time"] is None


_WRITER = """
import pathlib, sys, time
from wanka.resilience.ledger import FaultLedger
path, node, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
(go.parent / ("ready-" + node)).touch()
while not go.exists():  # start together: both create the new ledger at the same moment
    time.sleep(0.001)
led = FaultLedger(path)
for i in range(n):
    led.record("job", node, i % 4, "hang", step=i, detail="concurrent")
"""


def test_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "faults.sqlite"
    go = tmp_path / "go"
    n = 150
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), node, str(n), str(go)])
        for node in ("a", "b")
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{x}").exists() for x in "ab"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    led = FaultLedger(path)
    faults = led.faults()
    assert len(faults) == 2 * n
    assert len({f.id for f in faults}) == 2 * n
    assert sorted(f.step for f in led.faults(node="a")) == list(range(n))
    assert sorted(f.step for f in led.faults(node="b")) == list(range(n))


def test_corrupt_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "faults.sqlite"
    bad.write_bytes(b"this is not sqlite at all, just some bytes " * 100)
    with pytest.raises(ValueError) as e:
        FaultLedger(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and "move it aside" in msg and "delete" not in msg
    with pytest.raises(ValueError, match="no fault ledger at .*--ledger"):
        FaultLedger(tmp_path / "nope.sqlite", create=False)
    assert not (tmp_path / "nope.sqlite").exists()


def _cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="wanka")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_nodes_parser(sub)
    args = p.parse_args(argv)
    return args.fn(args)


def test_nodes_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "faults.sqlite"
    led = FaultLedger(path)
    led.record("job7", "node-a", 1, "hang", step=12, detail="SIGSTOP", time=T)
    led.record("job7", "node-a", 0, "hang", step=30, time=T + 5)
    led.record("job7", "node-b", 2, "nan", step=40, time=T + 9)
    ledger = ["--ledger", str(path)]

    assert _cli(["nodes", *ledger]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["node", "status", "faults", "counted"]
    a = next(line for line in out if line.startswith("node-a"))
    assert a.split()[1:4] == ["ok", "2", "2"] and "hang 2" in a
    assert any(line.startswith("node-b") and "nan 1" in line for line in out)

    assert _cli(["nodes", "faults", "--node", "node-a", *ledger]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "SIGSTOP" in out[1] and "job7" in out[1]
    assert " 12 " in out[1] and " 30 " in out[2]

    assert _cli(["nodes", *ledger, "evict", "node-a", "--reason", "flaky NIC"]) == 0
    assert "evicted" in capsys.readouterr().out
    assert led.evicted() == {"node-a": "flaky NIC"}
    _cli(["nodes", *ledger])
    assert "evicted: flaky NIC" in capsys.readouterr().out

    assert _cli(["nodes", "clear", "node-a", *ledger]) == 0
    assert led.evicted() == {}
    with pytest.raises(ValueError, match="'node-z' is not in the fault ledger"):
        _cli(["nodes", "clear", "node-z", *ledger])
    with pytest.raises(ValueError, match="no fault ledger at"):
        _cli(["nodes", "--ledger", str(tmp_path / "typo.sqlite")])
    empty = tmp_path / "empty.sqlite"
    FaultLedger(empty)
    capsys.readouterr()
    assert _cli(["nodes", "faults", "--ledger", str(empty)]) == 0
    assert "no faults recorded" in capsys.readouterr().out


def test_cli_default_ledger_matches_config() -> None:
    from wanka.config.schema import ResilienceConfig

    assert DEFAULT_LEDGER == ResilienceConfig().ledger
    p = argparse.ArgumentParser()
    add_nodes_parser(p.add_subparsers(dest="cmd"))
    assert p.parse_args(["nodes", "faults"]).ledger == DEFAULT_LEDGER
