"""resilience.control = "store" for a job of several hosts that torchrun's rendezvous brings
together (`wanka launch --slurm`, `--k8s`): one supervisor per host, one of them the coordinator.

Each host's `wanka train` supervises its own ranks (resilience/supervisor.py); without the store
each would see a remote rank's death as a local hang in a collective and decide alone. Here:

* The coordinator is the host torchrun's c10d rendezvous store runs on (SLURM_NODEID 0, else
  the host the rendezvous endpoint names, torch's own rule). Its supervisor serves the control
  store, a TCPStore on the rendezvous port + 1 (WANKA_CONTROL_PORT), for the job's lifetime;
  the others connect to it. Keys live under wanka/RDZV_ID/aN/ (control/store.py): the
  rendezvous id is the one name every host of the job shares (Slurm: job id and requeue count).
* Every host runs a node agent (control/agent.py) as a thread of its supervisor: it reads its
  own ranks' heartbeat files, in a host-local folder (/dev/shm), never the run directory, and
  publishes them, their process states and exit marks; on a stop decision it kills its ranks.
* The coordinator's Coordinator (control/coordinator.py) names the fault from the store alone
  ("rank 1 on node n1: process_crash"), writes it as the attempt's verdict, and decides:
  stop, then restart (attempt N+1, after the back-off) or end (with the job's exit code). The
  others follow: they never decide on their own, and start attempt N+1 when told.
* With resilience.spare_nodes = S, N - S hosts train and the others stand by as hot spares;
  after a fault the coordinator plans the next attempt's hosts (resilience/host_members.py): a
  spare takes a lost or evicted host's place, or the job goes on with fewer hosts. A host not
  in an attempt (a spare, an evicted host) keeps its supervisor running and waits for the next.
* A host that cannot reach the store for AGENT_TIMEOUT_S (the coordinator's host died or is
  cut off) stops its ranks and ends with exit 1: nobody is left to decide, and Slurm requeues
  the job (a node failure) or the user resubmits; it resumes from the newest DCP checkpoint.

Each attempt meets at a rendezvous of its own (RDZV_ID.aN): torch's c10d rendezvous is closed
once an attempt's agents shut down, and a closed one cannot be joined again.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

from wanka.control.agent import NodeAgent
from wanka.control.coordinator import Coordinator
from wanka.control.store import ControlStore
from wanka.resilience.host_members import live_hosts, plan_members, suspect_of
from wanka.resilience.host_setup import (
    CONTROL_ENDPOINT_ENV,
    CONTROL_PORT_ENV,
    children,
    control_address,
    is_coordinator,
    local_hb_root,
    safe_name,
)
from wanka.resilience.monitor import UNSTICK_AFTER_S, StopRequested
from wanka.resilience.snapshot import inventory, restorable

log = logging.getLogger("wanka.supervisor")
AGENT_POLL_S = 0.1
AGENT_TIMEOUT_S = 10.0  # a host's agent this long without a beat: the host is lost
CONNECT_S = 120.0  # for the coordinator's supervisor to start serving (it imports torch first)
OWNER_S = AGENT_TIMEOUT_S  # a store that does not say whose it is this long: not our coordinator's
# What a rank that died because a peer went says (gloo, NCCL, sockets): a victim. Explicit
# phrases only: a rank's own NCCL or I/O error (ncclUnhandledCudaError, a disk's read error,
# a data loader's time-out) is first-hand.
PEER_LOSS = re.compile(r"connection (reset|closed) by peer|connection refused|broken pipe|"
                       r"failed to recv|got 0 bytes|ncclRemoteError|remote process exit|"
                       r"socket timeout|timed out waiting .* for (recv|send)", re.IGNORECASE)  # fmt: skip
FIRST_PLAN_S = 600.0  # for enough hosts to reach the store (torchrun's rendezvous join time-out)


class HostControl:
    """One host's side of the control plane; `sup` is its Supervisor (nnodes > 1, no cluster)."""

    def __init__(self, sup) -> None:
        self.sup = sup
        self.rdzv_id = str(sup.rdzv.get("rdzv_id") or "")
        if not self.rdzv_id or self.rdzv_id == "none":
            raise ValueError("resilience.control = store across hosts needs --rdzv-id (the "
                             "job's name on every host, e.g. $SLURM_JOB_ID)")  # fmt: skip
        self.host, self.port = control_address(sup.rdzv)
        self.coordinating = is_coordinator(self.host)
        self.spares = max(int(sup.rc.spare_nodes), 0)
        self.width = sup.nnodes - self.spares  # hosts that train at once
        if self.width < 1:
            raise ValueError(f"resilience.spare_nodes={self.spares} leaves no host to train on: "
                             f"the job has {sup.nnodes} host(s) (--nnodes); set it below that")  # fmt: skip
        # attempt -> its hosts, as the coordinator planned them; an attempt without a plan
        # (the first, without spares) trains on every host.
        self.plans: dict[int, list[str]] = {}
        self.gone: set[str] = set()  # hosts found not beating between attempts
        self.evicted_now: set[str] = set()  # hosts of this job evicted (the coordinator's word)
        # attempt -> the step of the in-memory snapshots its ranks can resume from (None: the
        # newest DCP checkpoint), from the snapshot inventories the hosts publish
        self.snapshot_step: dict[int, int | None] = {}
        self.snap_dir = Path(sup.rc.snapshot_dir) / sup.job / sup.node
        self.world = sup.nproc * sup.nnodes
        self.attempt = 0
        self.view: ControlStore | None = None  # this attempt's keys
        self.agent: NodeAgent | None = None
        self.coordinator: Coordinator | None = None
        self.hb_root = local_hb_root() / safe_name(self.rdzv_id) / safe_name(sup.node)
        self.orphaned = False  # the store stopped answering: nobody is left to decide
        self._last_ok = time.monotonic()  # the last store call that answered
        self._before: set[int] = set()  # children of ours from before the attempt's ranks
        self._inflight: threading.Thread | None = None  # the store call under way, if any
        self._formed = False  # the coordinator said every host is in this attempt
        self._waited = 0  # the last attempt whose "next" this follower read
        try:
            if self.coordinating:
                self.server = ControlStore.serve("0.0.0.0", self.port, self.rdzv_id)
            else:
                self.server = ControlStore.connect(self.host, self.port, self.rdzv_id, CONNECT_S)
        except ConnectionError as e:
            raise ValueError(f"resilience.control = store: {e} (the port: {CONTROL_PORT_ENV} "
                             f"or {CONTROL_ENDPOINT_ENV})") from None  # fmt: skip
        self.root = ControlStore(self.server.store, self.host, self.port, self.rdzv_id)
        if not self.coordinating:
            self._check_owner()
        try:  # the job's hosts, spares included: the coordinator plans attempts from them
            self._answered(lambda: (self.root.register_node(sup.node), self._beat()))
        except ConnectionError as e:
            raise ValueError(f"resilience.control = store: {e}") from None

    def _check_owner(self) -> None:
        """A follower: the store it reached is its own job's coordinator's. Another job's (or
        an older run's) store on the port, where this job's coordinator then could not serve,
        would leave it waiting for an attempt that never comes."""
        deadline = time.monotonic() + OWNER_S
        where = f"no coordinator for job {self.rdzv_id} at {self.host}:{self.port}"
        while True:
            try:
                owner = self._answered(self.root.owner)
            except ConnectionError as e:
                raise ValueError(f"resilience.control = store: {e}") from None
            if owner == self.rdzv_id:
                return
            if owner is not None:
                raise ValueError(f"{where}: the store there belongs to job {owner!r} (another "
                                 "job's or an older run's coordinator holds that port, so this "
                                 "job's could not serve it); end that job, or give this one "
                                 f"another port ({CONTROL_PORT_ENV} on every host)")  # fmt: skip
            if time.monotonic() > deadline:
                raise ValueError(f"{where}: the store there belongs to another job (or the "
                                 f"coordinator did not start): it has not said whose it is "
                                 f"within {OWNER_S:.0f} s; check the coordinator host's log, or "
                                 f"give this job another port ({CONTROL_PORT_ENV} on every "
                                 "host)")  # fmt: skip
            time.sleep(AGENT_POLL_S)

    def _attempt_view(self, attempt: int) -> ControlStore:
        return ControlStore(self.server.store, self.host, self.port, f"{self.rdzv_id}/a{attempt}")

    # -- joining ------------------------------------------------------------------------------
    def join(self) -> tuple[int, dict | None]:
        """A follower before its first attempt: (the attempt to start, None), or, if the job
        ended meanwhile, (0, the coordinator's word). It waits for the coordinator to begin an
        attempt (its pre-flight may fail: then the job's end comes instead). A host that
        (re)starts while an attempt already formed without it (a pod replaced in place) cannot
        join that one: it waits for the next, rather than act on that attempt's stop."""
        first = self._attempt_view(1)
        while True:
            try:
                cur, nxt = self._answered(
                    lambda: (self._beat(), self.root.get("current"), first.get("next"))[1:]
                )
            except ConnectionError as e:
                if time.monotonic() - self._last_ok > AGENT_TIMEOUT_S:
                    self.orphaned = True
                    return 0, {"action": "end", "rc": 1, "own": True, "message": str(e)}
                time.sleep(AGENT_POLL_S)
                continue
            if cur is not None:
                break
            if nxt is not None:
                return 0, nxt
            if self.sup.stop_requested.is_set():
                raise StopRequested("stopped on request while waiting for the coordinator's "
                                    "first attempt")  # fmt: skip
            time.sleep(AGENT_POLL_S)
        at = int(cur["attempt"])
        if cur.get("members"):
            self.plans[at] = list(cur["members"])
        if not cur.get("formed") and not cur.get("over"):  # still forming: this one is ours
            return at, None
        log.warning("attempt %d of the job is under way without this host: joining the next",
                    at)  # fmt: skip
        nxt = self.wait_next(at)
        return (at + 1, None) if nxt["action"] == "restart" else (0, nxt)

    # -- per attempt ----------------------------------------------------------------------------
    def hb_dir(self, attempt: int) -> Path:
        return self.hb_root / f"attempt{attempt}"

    def rdzv(self, attempt: int) -> dict:
        """torchrun's rendezvous flags for `attempt`: a rendezvous of its own, of its hosts."""
        flags = {**self.sup.rdzv, "rdzv_id": f"{self.rdzv_id}.a{attempt}"}
        if attempt in self.plans:
            flags["nnodes"] = str(len(self.plans[attempt]))
        return flags

    # -- which hosts train (resilience/host_members.py) --------------------------------------
    def _beat(self) -> None:
        """This host's supervisor is alive (between attempts, and as a spare)."""
        self.root.beat_agent(self.sup.node, AGENT_POLL_S)

    def sits_out(self, attempt: int) -> bool:
        """This host is not one of `attempt`'s (a hot spare, or evicted)."""
        plan = self.plans.get(attempt)
        return plan is not None and self.sup.node not in plan

    def nnodes(self, attempt: int) -> int:
        """How many hosts `attempt` trains on (planned, or as it will be planned)."""
        plan = self.plans.get(attempt)
        return len(plan) if plan is not None else self.width

    def others(self, node: str) -> list[str]:
        """The hosts of the job that could train instead of `node` (not evicted, not gone)."""
        evicted = set(self.sup.ledger.evicted())
        hosts = self._answered(self.root.nodes)
        return [h for h in hosts if h != node and h not in evicted and h not in self.gone]

    def plan(self, attempt: int, cause: str | None = None, node: str | None = None) -> list[str]:
        """The coordinator: the hosts of `attempt`, after a fault of `cause` on `node` (none
        before the first). Waits for the others' beats (they may still be stopping their
        ranks); before the first attempt, for `width` hosts to reach the store."""
        evicted = set(self.sup.ledger.evicted())
        prev = self.plans.get(attempt - 1) or []
        waited_s, deadline = 0.0, time.monotonic() + FIRST_PLAN_S
        while True:
            hosts = self._answered(self.root.nodes)
            if not prev and attempt > 1:  # the attempt before trained on every host
                prev = self.plans[attempt - 1] = list(hosts)
            window = AGENT_TIMEOUT_S if prev else 1.0
            # Not waited for: the host just named lost, and hosts found gone before.
            lost = ({node} if cause == "node_lost" and node else set()) | self.gone
            live = live_hosts(lambda: self._answered(self.root.read_agents), hosts,
                              {self.sup.node}, window, AGENT_POLL_S, lost)  # fmt: skip
            # The coordinator's own host trains whatever the ledger says (it may have evicted it).
            if prev or len(live - (evicted - {self.sup.node})) >= self.width:
                break
            left = self._answered(lambda: self.root.get("left"))
            if left is not None:  # a host this attempt needs ended in its pre-flight
                raise ValueError(f"node {left['node']}: {left['message']}")
            if time.monotonic() > deadline:
                out = f"; evicted in the fault ledger: {', '.join(sorted(evicted & live))}" \
                    if evicted & live else ""  # fmt: skip
                raise ValueError(f"only {len(live - evicted)} of the {self.width} hosts this job "
                                 f"trains on reached the control store within {FIRST_PLAN_S:.0f} s "
                                 f"(live: {', '.join(sorted(live))}{out}); are the other hosts' "
                                 "tasks running, and is resilience.spare_nodes right?")  # fmt: skip
            if time.monotonic() - waited_s > 30:
                waited_s = time.monotonic()
                log.warning("waiting for hosts: %d of %d reached the control store",
                            len(live - evicted), self.width)  # fmt: skip
            if self.sup.stop_requested.is_set():
                raise StopRequested(f"stopped on request while waiting for hosts ({len(live - evicted)} "
                                    f"of {self.width} reached the control store)")  # fmt: skip
            time.sleep(AGENT_POLL_S)
        self.gone = set(hosts) - live
        self.evicted_now = evicted & set(hosts)
        suspect = suspect_of(cause, node) if cause else None
        members = plan_members(hosts, live, evicted, prev, self.width, suspect, self.sup.node)
        self.plans[attempt] = members
        if attempt > 1:  # where its ranks resume from, as the hosts' snapshot inventories say
            held = [self._answered(lambda h=h: self.root.get(f"snapshots/{h}")) for h in members]
            self.snapshot_step[attempt] = restorable([h or {} for h in held],
                                                     self.sup.nproc * len(members))  # fmt: skip
        return members

    def publish_snapshots(self) -> None:
        """What this host's memory holds of the job's snapshots (names only), for the
        coordinator's plan of the next attempt."""
        try:
            held = inventory(self.snap_dir)
            self._answered(lambda: self.root.put(f"snapshots/{self.sup.node}", held))
        except (ConnectionError, OSError) as e:
            log.error("control store: snapshot inventory not published: %s", e)

    def begin(self, attempt: int, _nodes=(), _spares=()) -> None:
        """Before `attempt` starts here. A store that does not answer leaves `orphaned` set
        (the supervisor then runs nothing and ends the job)."""
        import shutil

        shutil.rmtree(self.hb_root, ignore_errors=True)  # earlier attempts' records
        self.hb_dir(attempt).mkdir(parents=True, exist_ok=True)
        self.attempt, self.view = attempt, self._attempt_view(attempt)
        self._before = set(children())
        self.orphaned, self._formed = False, False
        try:
            if self.coordinating and attempt not in self.plans and self.spares:
                self.plan(attempt)  # the first attempt: which hosts train, which stand by
            hosts = self.plans.get(attempt)
            self.world = self.sup.nproc * (len(hosts) if hosts else self.sup.nnodes)
            self.agent = self._answered(
                lambda: NodeAgent(self.view, self.sup.node, self.hb_dir(attempt), AGENT_POLL_S,
                                  pgid=0, kill=self._kill_local, attempt=attempt,
                                  orphan_s=AGENT_TIMEOUT_S,
                                  stacks_dir=Path(self.sup.run_dir) / "logs"))  # fmt: skip
            if self.coordinating:
                planned = self.plans.get(attempt)  # a planned host that never joins is lost
                self.coordinator = Coordinator(self.view, self.world, self.sup.timeouts,
                                               AGENT_TIMEOUT_S, attempt=attempt,
                                               home=self.sup.node, nodes=planned,
                                               expect_s=AGENT_TIMEOUT_S if planned else None)  # fmt: skip
                self.root.put("current", {"attempt": attempt, "formed": False,
                                          "members": self.plans.get(attempt)})  # fmt: skip
        except ConnectionError as e:
            log.error("control store: %s", e)
            self.orphaned = True

    def _kill_local(self, _pgid: int, sig: int) -> None:
        """A stop: this host's ranks, the children of this process the elastic agent started
        for the attempt (forked or spawned; one still starting has no heartbeat record to name
        it): not those from before it, nor multiprocessing's resource tracker."""
        for pid, cmdline in children().items():
            if pid in self._before or b"resource_tracker" in cmdline:
                continue
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _answered(self, fn):
        """fn() (store calls) on a thread of its own, at most until AGENT_TIMEOUT_S after the
        last answer: a call into a frozen or vanished host blocks far longer than the store's
        time-out (until TCP gives up, or for ever). ConnectionError when it takes longer."""
        box: dict = {}
        prev = self._inflight
        if prev is not None and prev.is_alive():  # one call at a time: wait for the last one
            prev.join(max(0.0, self._last_ok + AGENT_TIMEOUT_S - time.monotonic()))
            if prev.is_alive():
                raise ConnectionError(f"the control store at {self.host}:{self.port} has not "
                                      f"answered for {AGENT_TIMEOUT_S:.0f} s")  # fmt: skip
        deadline = max(self._last_ok, time.monotonic()) + AGENT_TIMEOUT_S

        def run() -> None:
            try:
                box["value"] = fn()
                self._last_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001  (raised below, in the caller's thread)
                box["error"] = e

        t = self._inflight = threading.Thread(target=run, name="wanka-control-call", daemon=True)
        t.start()
        while t.is_alive():
            t.join(AGENT_POLL_S)
            if t.is_alive() and time.monotonic() > max(deadline, self._last_ok + AGENT_TIMEOUT_S):
                raise ConnectionError(f"the control store at {self.host}:{self.port} has not "
                                      f"answered for {AGENT_TIMEOUT_S:.0f} s")  # fmt: skip
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # -- watching ---------------------------------------------------------------------------
    def watch(self, _hb_dir: Path, attempt: int, out, stop: threading.Event) -> None:
        """The supervisor's monitor thread: publish this host's ranks; the coordinator also
        names faults and decides; a follower carries out the decisions."""
        failing, over, over_at = False, False, None
        self._last_ok = time.monotonic()
        while not self.orphaned:
            last = stop.wait(AGENT_POLL_S)
            now = time.time()
            if over:  # ranks that start after the verdict (a rendezvous completing late) too
                self._kill_local(0, signal.SIGKILL)
                over_at = over_at or time.monotonic()
                if not last and time.monotonic() - over_at > UNSTICK_AFTER_S:
                    # Our ranks are gone but the agent waits on (ranks that exited 0 mid-job).
                    self.sup.stop_stuck_launcher()
                    over_at = float("inf")  # once
                prev = self._inflight
                if prev is None or not prev.is_alive():  # never wait on a stuck store here
                    try:  # still up while our ranks go: the coordinator is planning
                        self._answered(self._beat)
                    except ConnectionError:
                        pass
                if last:
                    return
                continue
            try:
                # publishes; a stop decision kills our ranks. Never a last look that names a
                # death without waiting for the other hosts' beats: conclude() settles it.
                over = self._answered(functools.partial(self._poll, attempt, out, now))
                failing = False
            except ConnectionError as e:
                if not failing:
                    log.error("control store: %s", e)
                failing = True
                if not self.coordinating and time.monotonic() - self._last_ok > AGENT_TIMEOUT_S:
                    self._orphaned(out, now)
                    return
            except Exception as e:  # the monitor must outlive any one bad poll
                log.error("monitor poll failed: %s", e)
            if last:
                return

    def _settle(self, attempt: int, out) -> bool:
        """The coordinator's own attempt failed before the store named a fault. A remote host
        that went down takes our ranks with it (reset connections) before its silence passes
        the limit: keep looking as during the attempt (a death is named only once the other
        hosts' agents have beaten since) until the store names the fault, or the agents' limit
        has passed. True when it named one (now in `out`). When our rank died first-hand (its
        own exception, or a signal: not a lost peer's symptom), the remote ranks' deaths that
        follow are its consequence: a remote crash is not named instead of it."""
        first_hand = _first_hand(out)
        deadline = time.monotonic() + AGENT_TIMEOUT_S + 1.0
        while not self.orphaned and time.monotonic() < deadline:
            try:
                fault = self._answered(
                    lambda: (self.agent.poll_once(), self.coordinator.check(time.time()))[1]
                )
            except Exception as e:  # noqa: BLE001  (a bad look: ours is named instead)
                log.error("control store: %s", e)
                fault = None
            if fault is not None:
                remote_death = fault.cause in ("process_crash", "startup_failure")
                if first_hand and remote_death and fault.node != self.sup.node:
                    return False
                named = copy.copy(out)  # `out` changes only once the verdict is written
                fault.onto(named, time.time())
                try:
                    self._answered(
                        lambda f=fault, o=named: self._stop_all(attempt, o, f.describe())
                    )
                except Exception as e:  # noqa: BLE001
                    log.error("control store: %s", e)
                    return False
                fault.onto(out, named.t_detect)
                return True
            time.sleep(AGENT_POLL_S)
        return False

    def _poll(self, attempt: int, out, now: float) -> bool:
        """One look; True once the attempt is over (a verdict). Runs under _answered's
        deadline: a late one (the store answered after we gave up on it) changes nothing."""
        if self.orphaned:
            return False
        self.agent.poll_once()
        self._beat()  # this host is up, for the next attempt's plan (a slow teardown too)
        reports = self.view.read_ranks(self.world)
        steps = [rep.beat.step for rep in reports.values() if rep.beat.attempt == attempt]
        out.max_step = max([out.max_step, *steps])
        if ids := self.sup.chaos.inside_ids():  # every host: none replays a fault that fired
            self.sup.chaos.note_fired(self.view.read_chaos(ids))
        if not self.coordinating:
            verdict = self.view.get("verdict")
            if verdict is None:
                return False
            # The stop was written before the verdict: carry it out now, whatever the last
            # poll read; and the attempt is over here in any case.
            if not self.orphaned:
                _fill(out, verdict)
            self.agent.poll_once()
            self._kill_local(0, signal.SIGKILL)
            return True
        left = self.root.get("left")  # a host that ended on its own (its pre-flight failed)
        if left is not None:
            out.cause = "user_error" if left["rc"] == 2 else "startup_failure"
            out.node, out.detail, out.t_detect = left["node"], left["message"], now
            out.said = f"node {left['node']}: {left['message']}"
            self._stop_all(attempt, out, f"node {left['node']}: {left['message']}")
            return True
        hosts = self.plans.get(attempt)
        if (
            not self._formed
            and steps
            and len(self.view.nodes()) >= len(hosts or range(self.sup.nnodes))
        ):
            self._formed = True  # every host is in: a host starting now joins the next one
            self.root.put("current", {"attempt": attempt, "formed": True, "members": hosts})
        fault = self.coordinator.check(now)
        if fault is None:
            return False
        fault.onto(out, now)
        self._stop_all(attempt, out, fault.describe())
        self.agent.poll_once()  # ours at once
        return True

    def _stop_all(self, attempt: int, out, reason: str) -> None:
        """The decision first, then the verdict: a follower that sees the verdict finds the
        decision too."""
        self.coordinator.decide_stop(attempt, reason, dump=out.cause == "hang")
        self.view.put("verdict", _verdict(out, self.sup.node))
        self.root.put("current", {"attempt": attempt, "formed": self._formed, "over": True,
                                  "members": self.plans.get(attempt)})  # fmt: skip

    def _orphaned(self, out, now: float) -> None:
        self.orphaned = True
        try:
            self.agent._fence()
        except RuntimeError:  # an abandoned poll was changing the agent's records meanwhile
            pass
        self._kill_local(0, signal.SIGKILL)
        out.cause, out.rank, out.node = "node_lost", None, self.host
        out.detail = (f"the control store at {self.host}:{self.port} was unreachable for "
                      f"{AGENT_TIMEOUT_S:.0f} s: the coordinator's host is gone or cut off")  # fmt: skip
        out.t_detect = now

    def conclude(self, attempt: int, out) -> None:
        """After `attempt` ended here. The coordinator makes sure the others stop too when it
        ended on a fault seen here first (its own rank died: the agent ended the attempt before
        the store named it): the verdict is its own, the stop decision follows. Every host
        publishes its snapshot inventory for the next attempt's plan."""
        if out.cause != "success":
            self.publish_snapshots()
        if not self.coordinating or out.cause in ("success", "preempted"):
            return
        try:
            if self.view.get("verdict") is None:
                seen = (out.cause, out.rank, out.node)
                if self._settle(attempt, out):  # named from the store: not what we saw
                    if (out.cause, out.rank, out.node) != seen:
                        out.error = None  # the exception in our rank's log: not the cause
                    return
                self._stop_all(attempt, out, f"{out.cause}: {out.detail}")
        except ConnectionError as e:
            log.error("control store: %s", e)

    def leave(self, rc: int, message: str) -> None:
        """A follower ends before its first attempt (its pre-flight failed): the coordinator,
        waiting for it at the rendezvous, ends the job with the same code and reason."""
        if self.coordinating:
            return
        try:
            value = {"node": self.sup.node, "rc": rc, "message": message}
            self._answered(lambda: self.root.put("left", value))
        except ConnectionError as e:
            log.error("control store: %s", e)

    def abort(self, reason: str) -> None:
        """The coordinator's loop ended by an exception in an attempt: stop every host's
        ranks (no verdict will come from the watch)."""
        if not self.coordinating or self.view is None or self.coordinator is None:
            return
        try:
            if self.view.get("verdict") is None:
                from types import SimpleNamespace

                out = SimpleNamespace(cause="process_crash", rank=None, node=self.sup.node,
                                      detail=reason, t_fault=time.time(), t_detect=time.time(),
                                      limit_s=None)  # fmt: skip
                self._stop_all(self.attempt, out, reason)
        except ConnectionError as e:
            log.error("control store: %s", e)

    def exit_marks(self) -> dict[int, tuple[int, str]] | None:
        """Rank -> (exit code, message) of the ranks that exited on purpose (all hosts')."""
        if self.orphaned or self.agent is None:
            return None
        try:
            return self._answered(lambda: self._read_exits())
        except (ConnectionError, RuntimeError) as e:
            log.error("control store: %s", e)
            return None

    def _read_exits(self) -> dict[int, tuple[int, str]]:
        self.agent.poll_once()  # our ranks' last marks, before anyone reads them
        return {r: (e.code, e.message) for r, e in self.view.read_exits(self.world).items()}

    # -- between attempts -------------------------------------------------------------------
    def announce(self, attempt: int, action: str, rc: int = 0, message: str = "") -> None:
        """The coordinator's word on what follows `attempt`: "restart" or "end" (with rc);
        `message`: the fault it restarts after, or why the job ends."""
        if not self.coordinating:
            return
        value = {"action": action, "rc": rc, "message": message, "t": time.time(),
                 "members": self.plans.get(attempt + 1) if action == "restart" else None,
                 "evicted": sorted(self.evicted_now),
                 "snapshot_step": self.snapshot_step.get(attempt + 1)}  # fmt: skip
        try:
            self._attempt_view(attempt).put("next", value)
        except ConnectionError as e:
            log.error("control store: %s", e)

    def wait_next(self, attempt: int, preempt: threading.Event | None = None) -> dict:
        """A follower, after `attempt` ended here: the coordinator's word on what follows. The
        coordinator may sleep a back-off first; a store gone for AGENT_TIMEOUT_S ends the job."""
        gone = {"action": "end", "rc": 1, "own": True,
                "message": f"node {self.host}: node_lost (the control store at {self.host}:"
                f"{self.port} was unreachable for {AGENT_TIMEOUT_S:.0f} s: the coordinator's "
                "host is gone or cut off); this host's ranks are stopped and the job ends here "
                "(a requeued or resubmitted job resumes from the newest checkpoint)"}  # fmt: skip
        view = self._attempt_view(attempt)

        def look() -> dict | None:
            # Our agent keeps publishing meanwhile: the coordinator names a death of ours
            # (process_crash) from it, and would take our silence for a lost host.
            if attempt == self.attempt and self.agent is not None:
                self.agent.poll_once()
            self._beat()  # the coordinator plans the next attempt from the hosts that beat
            return view.get("next")

        while not self.orphaned:
            if preempt is not None and preempt.is_set():  # a stop request while we wait
                return {"action": "end", "rc": 75, "own": True,
                        "message": "stopped on request; run the same command again to resume"}  # fmt: skip
            try:
                nxt = self._answered(look)
                if nxt is not None:
                    self._waited = attempt
                    if nxt.get("members"):
                        self.plans[attempt + 1] = list(nxt["members"])
                    self.evicted_now = set(nxt.get("evicted") or ())
                    return nxt
            except ConnectionError:
                if time.monotonic() - self._last_ok > AGENT_TIMEOUT_S:
                    self.orphaned = True
                    break
            time.sleep(AGENT_POLL_S)
        return gone

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.hb_root, ignore_errors=True)
        if self.coordinating:
            # Followers read the last "next" after we are done with it: wait for each (a
            # moment), so our store does not go before they have read the job's end.
            self._wait_followers_read()
        elif not self.orphaned and (self.attempt or self._waited):  # the store may go now
            view = self._attempt_view(max(self.attempt, self._waited))
            try:
                self._answered(lambda: view.put(f"read/{self.sup.node}", {"t": time.time()}))
            except ConnectionError:
                pass

    def _wait_followers_read(self, timeout_s: float = 10.0) -> None:
        if self.view is None:  # ended before any attempt (pre-flight): followers poll at 10 Hz
            time.sleep(10 * AGENT_POLL_S)
            return
        deadline = time.monotonic() + timeout_s
        try:  # every host that may be waiting on our word (spares too), not those gone
            nodes = [n for n in self.root.nodes() if n != self.sup.node and n not in self.gone]
            while time.monotonic() < deadline:
                if all(self.view.get(f"read/{n}") is not None for n in nodes):
                    return
                time.sleep(AGENT_POLL_S)
        except ConnectionError:
            pass


def _first_hand(out) -> bool:
    """Our rank died of its own (its own exception, or killed from outside), not as a lost
    peer's victim: then a remote death that follows is its consequence. Unknown (a SIGABRT,
    as NCCL's watchdog ends a victim; no exception text) is not first-hand."""
    if out.cause not in ("process_crash", "startup_failure") or out.rank is None:
        return False
    if out.error:
        return not PEER_LOSS.search(out.error)
    code = (getattr(out, "exits", None) or {}).get(out.rank)
    return code is not None and code < 0 and code != -signal.SIGABRT


def _verdict(out, node: str | None = None) -> dict:
    return {"cause": out.cause, "rank": out.rank, "node": out.node or node,
            "detail": out.detail, "t_fault": out.t_fault, "t_detect": out.t_detect,
            "limit_s": out.limit_s}  # fmt: skip


def _fill(out, verdict: dict) -> None:
    out.cause, out.rank, out.node = verdict["cause"], verdict["rank"], verdict["node"]
    out.detail, out.t_fault = verdict["detail"], verdict["t_fault"]
    out.t_detect, out.limit_s = verdict["t_detect"], verdict.get("limit_s")
