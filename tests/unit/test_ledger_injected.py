"""`wanka nodes`' counted column counts what the eviction policy counts: injected faults (chaos
drills) and user errors never, as its footer says."""

from __future__ import annotations

from pathlib import Path

from wanka.resilience.ledger import EvictionPolicy, FaultLedger

T = 1_000_000.0  # a fixed "now" so the window arithmetic is exact


def test_summary_counts_what_eviction_counts(tmp_path: Path) -> None:
    led = FaultLedger(tmp_path / "faults.sqlite")
    led.record("j", "vm", 0, "startup_failure", time=T, injected=True)  # a drill's fail_start
    led.record("j", "vm", None, "startup_failure", time=T + 1, injected=True)
    led.record("j", "vm", 0, "user_error", time=T + 2)
    led.record("j", "vm", 0, "user_code", time=T + 3)
    led.record("j", "vm", 1, "hang", time=T + 4)  # the only one that says something of vm
    (vm,) = led.summary()
    assert vm["faults"] == 5 and vm["by_cause"]["startup_failure"] == 2
    assert vm["counted"] == 1
    # the policy agrees: 2 x startup_failure would evict under same_cause=2, were they counted
    assert led.evaluate("vm", EvictionPolicy(max_faults=2, same_cause=2), now=T + 5) is None


def test_summary_still_leaves_cleared_faults_out(tmp_path: Path) -> None:
    led = FaultLedger(tmp_path / "faults.sqlite")
    led.record("j", "n1", 0, "hang", time=T)
    led.clear("n1")
    led.record("j", "n1", 0, "hang", time=T + 1)
    led.record("j", "n1", 0, "hang", time=T + 2, injected=True)
    (n1,) = led.summary()
    assert (n1["faults"], n1["counted"]) == (3, 1)
