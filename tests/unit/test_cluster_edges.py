"""cluster-in-a-box edges: a damaged state file, bad rates and rank counts (one line each), and
two state dirs asking for the same --name (real namespaces: root only)."""

from __future__ import annotations

import argparse
import json
import math
import time

import pytest

from wanka.cluster import netns as nx
from wanka.cluster import testbed
from wanka.cluster.cli import add_cluster_parser
from wanka.cluster.state import STATE_FILE


def cluster(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="wanka")
    add_cluster_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["cluster", *argv])
    return a.fn(a)


GOOD = {"name": "fx1", "subnet": "10.231.177.0/28", "bridge": "fx1-br", "link_gbit": 1.0,
        "intra_gbit": None, "made": [["link", "fx1-br"]],
        "nodes": [{"name": "n0", "netns": "wanka-fx1-n0", "veth_host": "fx1-n0h",
                   "veth_node": "fx1-n0", "addr": "10.231.177.1", "root": ""}]}  # fmt: skip


@pytest.mark.parametrize("text", [
    "", "  \n", "{}", "[]", "null", "{bad json",
    json.dumps({**GOOD, "extra": 1}),
    json.dumps({**GOOD, "nodes": [{"name": "n0"}]}),
    json.dumps({**GOOD, "nodes": "n0"}),
    json.dumps({**GOOD, "made": [["link"]]}),
    json.dumps({**GOOD, "link_gbit": "fast"}),
])  # fmt: skip
@pytest.mark.parametrize("cmd", [["status"], ["down"], ["kill-node", "n0"], ["status", "--json"]])
def test_a_damaged_state_file_is_one_line_naming_it(tmp_path, text, cmd):
    (tmp_path / STATE_FILE).write_text(text)
    with pytest.raises(ValueError) as e:
        cluster(*cmd, "--state-dir", str(tmp_path))
    said = str(e.value)
    assert "\n" not in said and str(tmp_path / STATE_FILE) in said and "remove it" in said
    if not text.strip():
        assert "(empty)" in said


def test_a_good_state_file_still_loads(tmp_path):
    from wanka.cluster.state import load

    (tmp_path / STATE_FILE).write_text(json.dumps(GOOD))
    st = load(tmp_path)
    assert (
        st.name == "fx1" and st.nodes[0].netns == "wanka-fx1-n0" and st.made == [["link", "fx1-br"]]
    )


@pytest.mark.parametrize("rate", [math.inf, math.nan, 1e-12, 1e9, -1.0, 0.0])
@pytest.mark.parametrize("flag", ["--link-gbit", "--intra-gbit"])
def test_a_link_rate_out_of_range_is_one_line_before_anything_is_made(tmp_path, rate, flag,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(nx, "sh", lambda *a, **k: pytest.fail(f"ran {a}"))
    with pytest.raises(ValueError, match=f"{flag} .*: a rate of 0.001 to 1000 Gbit/s") as e:
        cluster("up", "--nodes", "1", "--name", "fx1", flag, str(rate), "--state-dir",
                str(tmp_path))  # fmt: skip
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n", ["0", "-1"])
def test_cluster_launch_with_no_ranks_is_one_line(tmp_path, n):
    with pytest.raises(ValueError, match=f"--nproc must be 1 or more \\(got {n}\\)"):
        cluster("launch", "--state-dir", str(tmp_path), "--nproc", n, "--", "train", "x.toml")


# -- real namespaces ---------------------------------------------------------------------------
needs_root = pytest.mark.skipif(nx.missing_requirements() is not None,
                                reason=str(nx.missing_requirements()))  # fmt: skip


@pytest.fixture
def two_dirs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    yield a, b
    for d in (b, a):  # whatever a failing test left up
        try:
            testbed.down(d)
        except ValueError:
            pass


@needs_root
def test_a_name_in_use_by_another_state_dirs_cluster_is_refused(two_dirs, capsys):
    a, b = two_dirs
    sub = "10.231.177.0/28"
    testbed.up(1, 1.0, None, "fx1", sub, a)
    with pytest.raises(ValueError, match=f"--name fx1 is used by the cluster recorded in {a}.*"
                       "pick another --name"):  # fmt: skip
        testbed.up(1, 1.0, None, "fx1", sub, b)
    assert testbed.status(a)["healthy"] and not testbed.status(b)["up"]
    assert cluster("down", "--state-dir", str(b)) == 0  # nothing of a's
    assert "no cluster was up" in capsys.readouterr().out
    assert testbed.status(a)["healthy"]
    # Once a's cluster is down, the name is free for b.
    testbed.down(a)
    testbed.up(1, 1.0, None, "fx1", sub, b)
    assert testbed.status(b)["healthy"]


@needs_root
def test_down_lists_only_what_it_removed(two_dirs, capsys):
    a, _ = two_dirs
    st = testbed.up(1, 1.0, None, "fx1", "10.231.177.0/28", a)
    testbed._remove("netns", st.nodes[0].netns)  # gone already (a node removed)
    nx.wait_gone([st.nodes[0].veth_host])
    assert cluster("down", "--state-dir", str(a)) == 0
    out = capsys.readouterr().out
    assert out.strip() == "removed fx1-br", out


@needs_root
def test_namespaces_running_processes_of_no_recorded_cluster_are_not_taken(two_dirs):
    import subprocess

    a, _ = two_dirs
    ns = "wanka-fx2-n0"
    nx.sh("ip", "netns", "add", ns)
    p = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "30"])
    try:
        for _ in range(50):  # until the sleep runs in there
            if nx.netns_pids(ns):
                break
            time.sleep(0.05)
        with pytest.raises(ValueError, match=f"--name fx2: the namespaces {ns} still run"):
            testbed.up(1, 1.0, None, "fx2", "10.231.178.0/28", a)
        assert p.poll() is None and ns in nx.netns_list()
        p.kill()
        p.wait()
        testbed.up(1, 1.0, None, "fx2", "10.231.178.0/28", a)  # leftovers only: cleaned up
        assert testbed.status(a)["healthy"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        testbed.down(a)
        if ns in nx.netns_list():
            nx.sh("ip", "netns", "del", ns)
