"""Hot spare nodes (resilience.spare_nodes) on a 3-node cluster-in-a-box, control store mode:
the job trains on n0 and n1 while n2 stands by with a warm launcher; when n1 is lost, n2 takes
its place (its node rank, so rank 1) at once instead of the job waiting for n1 to come back,
and the final state is bitwise the fault-free one's."""

from __future__ import annotations

import re

import pytest

from tests.cluster.test_control_store_mode import (
    ledger_fault,
    node_of_rank,
    resumed_from_snapshot,
    train,
)
from wanka.cluster.fixtures import cluster_up, skip_unless_available
from wanka.resilience.ledger import EvictionPolicy, FaultLedger

SPARE = "resilience.spare_nodes=1"


@pytest.fixture(scope="module")
def three_nodes():
    skip_unless_available()
    with cluster_up(3, link_gbit=0.5, name="wks", subnet="10.231.6.0/24") as c:
        yield c


@pytest.fixture(scope="module")
def reference(three_nodes, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    _, run, summary = train(three_nodes, tmp, "run", None, SPARE)
    # The spare trained nothing: the world is n0 and n1.
    assert [node_of_rank(three_nodes, run, r, attempt=1) for r in (0, 1)] == ["n0", "n1"]
    return summary


def lost_line(stderr: str) -> re.Match:
    m = re.search(r"wanka train: node (n\d): node_lost \((.*)\); restart 1 in", stderr)
    assert m, stderr[-3000:]
    return m


def test_a_lost_node_is_replaced_by_the_spare(three_nodes, tmp_path, reference):
    r, run, summary = train(three_nodes, tmp_path, "run", "node_kill@step=3,node=1", SPARE)
    m = lost_line(r.stderr)
    assert m.group(1) == "n1" and "agent was killed (SIGKILL)" in m.group(2)
    assert "hot spare n2 takes the place of n1" in r.stderr
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("node_lost", None, "n1")
    # Injected: kept for the record, never counted toward evicting n1.
    strict = EvictionPolicy(max_faults=1, window_s=3600, same_cause=1)
    assert FaultLedger(str(tmp_path / "faults.sqlite")).evaluate("n1", strict) is None
    # Rank 0 stayed on n0 (its snapshot in n0's memory); rank 1 moved to n2, which had no copy
    # of its state: it got it from n0's replica over the network.
    assert [node_of_rank(three_nodes, run, r, attempt=2) for r in (0, 1)] == ["n0", "n2"]
    assert len(resumed_from_snapshot(run)) == 2
    assert summary["state_digest"] == reference["state_digest"]


@pytest.mark.slow  # waits out the hang limit; the node_kill case covers the wiring in CI
def test_a_cut_off_node_is_replaced_without_waiting_for_its_link(three_nodes, tmp_path,
                                                                 reference):  # fmt: skip
    r, run, summary = train(three_nodes, tmp_path, "run", "link_cut@step=3,node=1,for=60",
                            SPARE, "resilience.hang_floor_s=3.0")  # fmt: skip
    assert lost_line(r.stderr).group(1) == "n1"
    assert "hot spare n2 takes the place of n1" in r.stderr
    assert [node_of_rank(three_nodes, run, r, attempt=2) for r in (0, 1)] == ["n0", "n2"]
    assert summary["state_digest"] == reference["state_digest"]


@pytest.mark.slow  # waits out the hang limit and the cut
def test_a_cut_off_store_node_is_named_not_the_nodes_that_lost_it(three_nodes, tmp_path):
    # Three nodes train, the store on n0; n0's link is cut: n1's and n2's agents go quiet,
    # n0's still beats (it reaches the store inside n0). n0 is named (and the next attempt
    # uses the standby store, never a store on the node the fault was named on).
    r, run, summary = train(three_nodes, tmp_path, "run", "link_cut@step=3,node=0,for=8",
                            "resilience.hang_floor_s=3.0", world=3)  # fmt: skip
    m = lost_line(r.stderr)
    assert m.group(1) == "n0" and "unreachable from every other node (n1, n2)" in m.group(2)
    assert "restart 2" not in r.stderr  # and the job went on (train() checks it finished)


def test_spares_that_leave_no_node_to_train_on_are_refused_in_one_line(three_nodes, tmp_path):
    import subprocess
    import sys

    from tests.cluster.test_control_store_mode import REPO

    r = subprocess.run(
        [sys.executable, "-m", "wanka.cli", "train", "configs/demo.toml", "--cluster", "--nproc",
         "1", "--cluster-state", three_nodes.state_dir, "--set", "resilience.spare_nodes=3",
         "--set", f'run.dir="{tmp_path / "run"}"'],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "resilience.spare_nodes=3 leaves no node" in lines[0], lines
