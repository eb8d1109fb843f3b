"""Which hosts of a multi-host job train in each attempt (resilience/host_control.py).

With `resilience.spare_nodes = S` a job of N hosts (`--nnodes N`, one `wanka train` per host)
trains on N - S of them; the others are hot spares: their supervisors run and beat, their
ranks do not start. After a fault the coordinator plans the next attempt by the rules of the
cluster-in-a-box (cluster_attempt.choose_nodes): a spare takes the place of the host the fault
was named on (lost or hung) and of an evicted one, so the world keeps its size and the ranks
restore from in-memory snapshots (a moved rank fetches its copy); with no spare left an
evicted host, or one whose supervisor has stopped beating, is dropped and the job goes on with
a smaller world, from the newest DCP checkpoint (snapshots fit only their own world size).
The coordinator's own host always trains: torchrun's rendezvous store runs on it.

Liveness between attempts: every host's supervisor beats the job-level registry of the control
store (`agent/NODE` with a counter, ControlStore.beat_agent) while it waits; a host is live
when its counter moves. Counters, not clocks: the hosts' clocks need not agree."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from wanka.control.store import AgentBeat
from wanka.resilience.cluster_attempt import SUSPECT_CAUSES, choose_nodes


@dataclass(frozen=True)
class Host:
    name: str  # choose_nodes reads only the name


def live_hosts(read_agents: Callable[[], dict[str, AgentBeat]], hosts: list[str],
               given: set[str], window_s: float, poll_s: float,
               unlikely: set[str] = frozenset()) -> set[str]:  # fmt: skip
    """The hosts among `hosts` whose beat counter moves within `window_s` (`given` are live
    without looking: this host); `read_agents`: ControlStore.read_agents of the job's root.
    Returns once every host has moved, or every one but the `unlikely` (a host just named
    lost: not waited for)."""
    first = {n: b.count for n, b in read_agents().items()}
    live = {h for h in hosts if h in given}
    awaited = set(hosts) - set(unlikely)
    deadline = time.monotonic() + window_s
    while not awaited <= live and time.monotonic() < deadline:
        time.sleep(poll_s)
        for name, beat in read_agents().items():
            if name in hosts and beat.count != first.get(name):
                live.add(name)
    return live


def plan_members(hosts: list[str], live: set[str], evicted: set[str], prev: list[str],
                 width: int, suspect: str | None, home: str) -> list[str]:  # fmt: skip
    """The hosts of the next attempt, `home` (the coordinator's) first; `prev`: the last
    attempt's (empty before the first); `suspect`: the host the last fault was named on."""
    usable = [h for h in hosts if h not in evicted and h in live]
    order = [home, *(h for h in usable if h != home)]
    # A host of `prev` that is gone or evicted keeps its slot for a spare (or is dropped).
    chosen = choose_nodes([Host(h) for h in order], prev, width,
                          suspect if suspect != home else None)  # fmt: skip
    names = [n.name for n in chosen]
    if home not in names:  # the rendezvous store runs on the coordinator's host
        names = [home, *names][:width]
    return [home, *(n for n in names if n != home)]


def suspect_of(cause: str, node: str | None) -> str | None:
    """The host a spare should replace after a fault of `cause` on `node`."""
    return node if cause in SUSPECT_CAUSES else None
