"""The control plane's edges: a store of another job on the control port, a store that accepts
but never answers (frozen, SIGSTOPped, another service), against real TCPStores in-process."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from wanka.control.agent import NodeAgent
from wanka.control.store import ControlStore
from wanka.resilience import host_control as hc

from .test_host_control import _free_port, fake_sup


@pytest.fixture
def follower_env(tmp_path, monkeypatch):
    monkeypatch.setattr(hc, "local_hb_root", lambda: tmp_path / "shm")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.delenv(hc.CONTROL_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(hc.CONTROL_PORT_ENV, raising=False)
    return tmp_path


def test_a_follower_on_another_jobs_store_says_so_at_once(follower_env):
    """The control port is held by another job's coordinator (this job's failed to serve it):
    the follower says whose store it found, instead of waiting for an attempt for ever."""
    port = _free_port()
    other = ControlStore.serve("127.0.0.1", port, "41.0", timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        hc.HostControl(fake_sup(follower_env, "n1", port, rdzv_id="77.0"))
    said = str(e.value)
    assert time.monotonic() - t0 < 5
    assert said.startswith(f"no coordinator for job 77.0 at 127.0.0.1:{port}: the store there "
                           "belongs to job '41.0'")  # fmt: skip
    assert "\n" not in said and hc.CONTROL_PORT_ENV in said
    assert other.nodes() == [] and other.owner() == "41.0"  # nothing of ours was written there


def test_a_follower_on_a_store_that_never_says_whose_it_is_gives_up(follower_env, monkeypatch):
    """A TCPStore that is no wanka coordinator's (torchrun's own, an older wanka's): bounded."""
    monkeypatch.setattr(hc, "OWNER_S", 1.0)
    port = _free_port()
    plain = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=20),
                          wait_for_workers=False)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"no coordinator for job 77\.0 at .*another job \(or "
                       r"the coordinator did not start\)"):  # fmt: skip
        hc.HostControl(fake_sup(follower_env, "n1", port, rdzv_id="77.0"))
    assert time.monotonic() - t0 < 8
    del plain


def test_the_coordinators_own_followers_join_as_before(follower_env, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("SLURM_NODEID", "0")
    head = hc.HostControl(fake_sup(follower_env, "n0", port))
    monkeypatch.setenv("SLURM_NODEID", "1")
    follower = hc.HostControl(fake_sup(follower_env, "n1", port))
    assert sorted(head.root.nodes()) == ["n0", "n1"]
    for c in (head, follower):
        c.orphaned = True


@pytest.fixture
def silent_port():
    """A listener that accepts connections and never says a word (a frozen store)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    conns: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        s.settimeout(0.1)
        while not done.is_set():
            try:
                conns.append(s.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield s.getsockname()[1]
    done.set()
    t.join()
    for c in conns:
        c.close()
    s.close()


def test_connecting_to_a_store_that_never_answers_fails_within_the_time_out(silent_port):
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{silent_port} within 2 s"):
        ControlStore.connect("127.0.0.1", silent_port, "job1", timeout_s=2)
    assert time.monotonic() - t0 < 6


def test_a_follower_whose_store_never_answers_is_one_line_within_connect_s(
    follower_env, silent_port, monkeypatch
):
    monkeypatch.setattr(hc, "CONNECT_S", 2.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot reach the control store at 127.0.0.1:"
                       f"{silent_port} within 2 s"):  # fmt: skip
        hc.HostControl(fake_sup(follower_env, "n1", silent_port))
    assert time.monotonic() - t0 < 6


def test_an_agent_whose_store_stops_answering_fences_within_orphan_s(tmp_path):
    """A store call that blocks (the store's process SIGSTOPped: torch's time-out does not
    bound the read) must not keep the agent from stopping its node's ranks after orphan_s."""
    srv = ControlStore.serve("127.0.0.1", 0, "job1", timeout_s=20)
    store = ControlStore.connect("127.0.0.1", srv.port, "job1", timeout_s=20)
    killed = []
    agent = NodeAgent(store, "n1", tmp_path, 0.05, pgid=779, orphan_s=1.0,
                      kill=lambda pg, sig: killed.append((pg, sig)))  # fmt: skip
    frozen, stop = threading.Event(), threading.Event()
    real = store.beat_agent

    def beat(node, poll_s):
        if frozen.is_set():
            stop.wait(60)  # blocked in a read, as against a stopped store
        return real(node, poll_s)

    store.beat_agent = beat
    t = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    t.start()
    time.sleep(0.5)
    assert killed == []
    frozen.set()
    t0 = time.monotonic()
    while not killed and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    took = time.monotonic() - t0
    stop.set()
    t.join(5)
    assert killed == [(779, __import__("signal").SIGKILL)] and agent.fenced
    assert took < 3, took
    assert not t.is_alive()


@pytest.mark.parametrize("endpoint,env,match", [
    ("127.0.0.1:65535", None, r"--rdzv-endpoint '127\.0\.0\.1:65535': the control store takes "
                              r"the rendezvous port \+ 1, and 65536 is no port: .*1-65534"),
    ("127.0.0.1:²", None, r"needs --rdzv-endpoint HOST:PORT, the port 1-65535 \(got '127"),
    ("127.0.0.1:29500", "²", r"WANKA_CONTROL_PORT='²': a port number 1-65535"),
    ("127.0.0.1:29500", "65536", r"WANKA_CONTROL_PORT='65536': a port number 1-65535"),
])  # fmt: skip
def test_a_control_port_out_of_range_is_one_line_naming_its_source(monkeypatch, endpoint, env,
                                                                   match):  # fmt: skip
    monkeypatch.delenv(hc.CONTROL_ENDPOINT_ENV, raising=False)
    if env is None:
        monkeypatch.delenv(hc.CONTROL_PORT_ENV, raising=False)
    else:
        monkeypatch.setenv(hc.CONTROL_PORT_ENV, env)
    with pytest.raises(ValueError, match=match) as e:
        hc.control_address({"rdzv_endpoint": endpoint})
    assert "\n" not in str(e.value)
    monkeypatch.setenv(hc.CONTROL_PORT_ENV, "31000")  # the way out it names
    if env is None and endpoint.endswith("65535"):
        assert hc.control_address({"rdzv_endpoint": endpoint}) == ("127.0.0.1", 31000)
