"""Python API for tests: `cluster_up(...)` (a context manager) and the `wanka_cluster` pytest
fixture, which skips (saying why) where the testbed cannot run and always tears down. Use from
a conftest: `from wanka.cluster.fixtures import wanka_cluster  # noqa: F401`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from wanka.cluster import launch, nodes, testbed
from wanka.cluster.netns import missing_requirements
from wanka.cluster.state import ClusterState, Node, require

FIXTURE_PID = "fixture.pid"  # the test process that brought a fixture's cluster up


class Cluster:
    """A live cluster and its state dir; every action re-reads the state file."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    @property
    def state(self) -> ClusterState:
        return require(self.state_dir)

    def node(self, name: str) -> Node:
        return self.state.node(name)

    def popen(self, node: str, cmd: list[str], **kw) -> subprocess.Popen:
        return nodes.popen(self.node(node), cmd, **kw)

    def run(self, node: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run to completion inside `node`, capturing text output."""
        n = self.node(node)
        env = nodes.node_env(n, kw.pop("env", None))
        kw.setdefault("capture_output", True)
        return subprocess.run(nodes.exec_argv(n, cmd), env=env, text=True, **kw)

    def run_on_cluster(self, nproc_per_node: int, target: list[str], timeout: float = 300) -> int:
        return launch.run_on_cluster(nproc_per_node, target, self.state_dir, timeout=timeout)

    def kill_node(self, node: str) -> int:
        return nodes.kill_node(self.state, node)

    def cut_link(self, node: str) -> None:
        nodes.set_link(self.state, node, False)

    def restore_link(self, node: str) -> None:
        nodes.set_link(self.state, node, True)

    def remove_node(self, node: str) -> None:
        nodes.remove_node(self.state, node)

    def start_node(self, node: str) -> None:
        nodes.start_node(self.state, node, self.state_dir)

    def status(self) -> dict:
        return testbed.status(self.state_dir)


@contextmanager
def cluster_up(nodes: int = 2, link_gbit: float = 1.0, intra_gbit: float | None = None,
               name: str = "wkt", subnet: str = "10.231.1.0/24") -> Iterator[Cluster]:  # fmt: skip
    """A cluster with its own state dir, name and subnet (so it never touches the default one),
    torn down on exit whatever happened inside."""
    _down_if_abandoned(name)
    sdir = tempfile.mkdtemp(prefix=f"wanka-cluster-{name}-")
    try:
        Path(sdir, FIXTURE_PID).write_text(str(os.getpid()))
        testbed.up(nodes, link_gbit, intra_gbit, name=name, subnet=subnet, sdir=sdir)
        yield Cluster(sdir)
    finally:
        testbed.down(sdir)
        shutil.rmtree(sdir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _down_if_abandoned(name: str) -> None:
    """Take down a cluster of this name that an earlier test process brought up and never took
    down (killed mid-test): made by cluster_up (its state dir records the test's pid) and that
    process is gone. Anything else keeps the name and `up` refuses as for any user."""
    owner = testbed.owner_of(name)
    if owner is None:
        return
    try:
        pid = int(Path(owner, FIXTURE_PID).read_text())
    except (OSError, ValueError):
        return  # not a fixture's cluster, or not ours to judge
    if pid == os.getpid() or _pid_alive(pid):
        return
    print(f"taking down the test cluster {name} left up by the ended test process {pid} "
          f"({owner})", file=sys.stderr)  # fmt: skip
    testbed.down(owner)
    shutil.rmtree(owner, ignore_errors=True)


def skip_unless_available() -> None:
    why = missing_requirements()
    if why:
        pytest.skip(f"cluster testbed unavailable: {why}")


@pytest.fixture(scope="module")
def wanka_cluster() -> Iterator[Cluster]:
    """2 nodes, 0.5 Gbit/s links (fast enough for tests, slow enough to measure the shaping)."""
    skip_unless_available()
    with cluster_up(2, link_gbit=0.5) as c:
        yield c
