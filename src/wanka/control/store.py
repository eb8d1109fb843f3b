"""The control plane's shared state: a torch.distributed TCPStore, every key under wanka/{job}/.

The coordinator serves the store (or, later, reuses the one torchrun's c10d rendezvous runs);
one agent per host connects as a client. Keys, relative to wanka/{job}/:

    nodes                 JSON list of the node names whose agents registered (compare_set)
    agent/{node}          JSON {"count", "t", "poll_s"}: the agent's liveness beat
    agent/{node}/count    the beat's counter (store.add: only ever grows)
    rank/{r}              rank r's heartbeat record (heartbeat.py's packed bytes, RECORD_SIZE)
                          followed by JSON {"node", "state"}: where it runs, its process state
    exit/{r}              JSON {"code", "message", "node", "attempt", "t"}: rank r exited
    decision              JSON {"action", "attempt", "reason", "seq", "t"}: the coordinator's
    decision/seq          the decisions' counter (store.add)
    done/{node}           JSON: the last decision that node's agent carried out, and when
    chaos/{id}            JSON {"t", "node"}: an injected fault fired inside a rank (its mark)
    verdict, next, ...    JSON written with put(): the fault an attempt ended on, what follows
                          it (resilience/host_control.py)

One key lies outside every job's: wanka/serving, the job whose coordinator serves the store
(ControlStore.serve): a follower that reached another job's store says so at once.

A rank's record and its state travel in one value, so a reader never pairs a new record with an
old state. Every store call that fails for want of the server raises ConnectionError naming
host:port: the caller prints one line, not a C++ stack.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from wanka.resilience.heartbeat import RECORD_SIZE, Beat, unpack_beat
from wanka.resilience.monitor import DEAD_STATES, GONE  # noqa: F401  (re-exported)

T = TypeVar("T")
OWNER_KEY = "wanka/serving"  # the job whose coordinator serves the store (ControlStore.serve)


unpack_record = unpack_beat  # the record format is heartbeat.py's own: one definition


@dataclass(frozen=True)
class RankReport:
    beat: Beat
    node: str
    state: str  # R, S, D, T, Z ... from /proc on the rank's host, or "gone"


@dataclass(frozen=True)
class AgentBeat:
    node: str
    count: int
    t: float  # the agent's clock when it beat
    poll_s: float


@dataclass(frozen=True)
class ExitReport:
    rank: int
    code: int
    message: str
    node: str
    attempt: int | None  # the attempt of the rank's last heartbeat, when it had one


class ControlStore:
    def __init__(self, store: dist.Store, host: str, port: int, job: str) -> None:
        self.store, self.host, self.port, self.job = store, host, port, job
        self.prefix = f"wanka/{job}/"

    @classmethod
    def serve(cls, host: str, port: int, job: str, timeout_s: float = 30.0) -> ControlStore:
        """Host the store in this process (port 0: any free port; see `.port`)."""
        try:
            store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                                  wait_for_workers=False)  # fmt: skip
        except dist.DistError as e:
            raise ConnectionError(
                f"cannot serve the control store on {host}:{port}: {_first_line(e)} "
                "(is the port in use, or the address not this host's?)"
            ) from None
        store.set(OWNER_KEY, job)  # a follower of another job that finds this store says so
        return cls(store, host, store.port, job)

    @classmethod
    def connect(cls, host: str, port: int, job: str, timeout_s: float = 30.0) -> ControlStore:
        """Join the store the coordinator serves; fails within about `timeout_s`, also where
        something accepts the connection but never answers (a frozen store, another service):
        torch's time-out does not bound a blocked read there."""
        said = (f"cannot reach the control store at {host}:{port} within {timeout_s:.0f} s: "
                "is the coordinator running, and is that port open from this host?")  # fmt: skip
        try:
            store = call_within(
                lambda: dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s)),
                timeout_s + 1.0,
                said,
            )
        except dist.DistError:
            raise ConnectionError(said) from None
        return cls(store, host, port, job)

    def owner(self) -> str | None:
        """The job whose coordinator serves this store (None: not a wanka coordinator's, or
        one that has not said yet)."""
        raw = self._get_if_set(OWNER_KEY)
        return raw.decode(errors="replace") if raw is not None else None

    # -- plumbing ----------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except dist.DistError as e:
            raise ConnectionError(
                f"the control store at {self.host}:{self.port} failed to {what}: "
                f"{_first_line(e)} (is the coordinator still running?)"
            ) from None

    def _get_if_set(self, key: str) -> bytes | None:
        # get() on a missing key waits for it until the store's time-out: ask first.
        if not self._call("check a key", self.store.check, [key]):
            return None
        return self._call("read a key", self.store.get, key)

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The keys that are set, in two round trips when all are (the usual case)."""
        if not keys:
            return {}
        if self._call("check keys", self.store.check, keys):
            present = keys
        else:
            present = [k for k in keys if self._call("check a key", self.store.check, [k])]
        values = self._call("read keys", self.store.multi_get, present) if present else []
        return dict(zip(present, values))

    def _json(self, key: str) -> dict | None:
        raw = self._get_if_set(key)
        return json.loads(raw) if raw is not None else None

    # -- ranks -------------------------------------------------------------------------------
    def publish_rank(self, rank: int, record: bytes, node: str, state: str) -> None:
        """Rank `rank`'s latest heartbeat record as its file holds it, with its host's view."""
        if len(record) != RECORD_SIZE:
            raise ValueError(f"a heartbeat record is {RECORD_SIZE} bytes, got {len(record)}")
        tail = json.dumps({"node": node, "state": state}).encode()
        self._call("publish a rank", self.store.set, self._key("rank", rank), record + tail)

    def read_ranks(self, world_size: int) -> dict[int, RankReport]:
        keys = {self._key("rank", r): r for r in range(world_size)}
        out = {}
        for key, raw in self._get_many(list(keys)).items():
            beat = unpack_record(raw[:RECORD_SIZE], keys[key])
            if beat is not None:
                tail = json.loads(raw[RECORD_SIZE:])
                out[beat.rank] = RankReport(beat, tail["node"], tail["state"])
        return out

    def report_exit(
        self, rank: int, code: int, message: str, node: str, attempt: int | None
    ) -> None:
        value = {"code": code, "message": message, "node": node, "attempt": attempt,
                 "t": time.time()}  # fmt: skip
        self._call("report an exit", self.store.set, self._key("exit", rank), json.dumps(value))

    def read_exits(self, world_size: int) -> dict[int, ExitReport]:
        keys = {self._key("exit", r): r for r in range(world_size)}
        out = {}
        for key, raw in self._get_many(list(keys)).items():
            v = json.loads(raw)
            r = keys[key]
            out[r] = ExitReport(r, v["code"], v["message"], v["node"], v["attempt"])
        return out

    def report_chaos(self, fault_id: int, t: float, node: str) -> None:
        """A drill's fault fired inside a rank on `node` at `t` (the rank's mark file)."""
        value = json.dumps({"t": t, "node": node})
        self._call("report a chaos mark", self.store.set, self._key("chaos", fault_id), value)

    def read_chaos(self, fault_ids: list[int]) -> dict[int, tuple[float, str]]:
        """fault id -> (when, node) of those among `fault_ids` that fired."""
        keys = {self._key("chaos", i): i for i in fault_ids}
        out = {}
        for key, raw in self._get_many(list(keys)).items():
            v = json.loads(raw)
            out[keys[key]] = (float(v["t"]), v["node"])
        return out

    # -- agents ------------------------------------------------------------------------------
    def register_node(self, node: str) -> None:
        """Add `node` to the registry; compare_set, so agents starting together lose nobody."""
        key, seen = self._key("nodes"), ""  # expected "" sets only where the key is absent
        while True:
            names = json.loads(seen) if seen else []
            if node in names:
                return
            want = json.dumps(sorted([*names, node]))
            now = self._call("register a node", self.store.compare_set, key, seen, want)
            if now.decode() == want:
                return
            seen = now.decode()  # another agent registered first: retry on its list

    def nodes(self) -> list[str]:
        raw = self._get_if_set(self._key("nodes"))
        return json.loads(raw) if raw is not None else []

    def beat_agent(self, node: str, poll_s: float) -> int:
        """The agent on `node` is alive; returns the beat's counter (1, 2, ...)."""
        count = self._call("count a beat", self.store.add, self._key("agent", node, "count"), 1)
        value = {"count": count, "t": time.time(), "poll_s": poll_s}
        self._call("publish a beat", self.store.set, self._key("agent", node), json.dumps(value))
        return count

    def read_agents(self) -> dict[str, AgentBeat]:
        keys = {self._key("agent", n): n for n in self.nodes()}
        out = {}
        for key, raw in self._get_many(list(keys)).items():
            v = json.loads(raw)
            out[keys[key]] = AgentBeat(keys[key], v["count"], v["t"], v["poll_s"])
        return out

    # -- decisions ---------------------------------------------------------------------------
    def write_decision(self, action: str, attempt: int, reason: str, **extra: Any) -> dict:
        """The coordinator's word to every agent (`extra`: e.g. dump=True, stacks first).
        `seq` tells a new decision from one an agent already carried out, even when two say
        the same."""
        seq = self._call("count a decision", self.store.add, self._key("decision", "seq"), 1)
        value = {"action": action, "attempt": attempt, "reason": reason, "seq": seq,
                 "t": time.time(), **extra}  # fmt: skip
        self._call("write a decision", self.store.set, self._key("decision"), json.dumps(value))
        return value

    def read_decision(self) -> dict | None:
        return self._json(self._key("decision"))

    def put(self, name: str, value: dict) -> None:
        """A JSON value under wanka/{job}/{name}."""
        self._call("write a key", self.store.set, self._key(name), json.dumps(value))

    def get(self, name: str) -> dict | None:
        """What put() wrote under `name`, or None (without waiting for it)."""
        return self._json(self._key(name))

    def report_done(self, node: str, decision: dict, detail: str) -> None:
        value = {**decision, "detail": detail, "done_t": time.time()}
        self._call("report a decision done", self.store.set, self._key("done", node),
                   json.dumps(value))  # fmt: skip

    def read_done(self) -> dict[str, dict]:
        """Per node, the last decision its agent carried out (with `detail`, `done_t`)."""
        keys = {self._key("done", n): n for n in self.nodes()}
        return {keys[k]: json.loads(v) for k, v in self._get_many(list(keys)).items()}


def call_within(fn: Callable[[], T], timeout_s: float, said: str) -> T:
    """fn() on a thread of its own, for at most `timeout_s`: ConnectionError(`said`) when it
    takes longer (the thread is left behind, a daemon, blocked where the store left it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (raised below, in the caller's thread)
            box["error"] = e

    t = threading.Thread(target=run, name="wanka-store-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ConnectionError(said)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
