"""The node agent: one per host, the only reader of that host's heartbeat files.

Every poll it reads the local ranks' heartbeat records and exit marks (resilience/heartbeat.py),
looks up each rank's process state in /proc (only this host can), publishes all of it to the
control store, then beats its own liveness counter: a beat that advanced means the rank data
before it is fresh. It then follows the coordinator's decision: on "stop" it kills the process
group it was given (the local torchrun and its ranks), or that of the command it started.

    python -m wanka.control.agent --host H --port P --job J --node N --hb-dir DIR [--pgid G]
    python -m wanka.control.agent --host H ... --hb-dir DIR -- torchrun ...
    python -m wanka.control.agent --store-from-orders ... -- python -m wanka.resilience.node_launch
        (a warm launcher: the command starts at once, the store's address comes with the
        orders on stdin, which the agent passes on without it)

With a command after `--` the agent starts it in a process group of its own (the group a stop
kills), forwards SIGTERM to it (torchrun passes it on to its ranks: the last-gasp checkpoint),
publishes once more when it exits, and exits with its code (128 + N for signal N).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from wanka.resilience.heartbeat import RECORD_SIZE, exit_code, exit_message
from wanka.resilience.monitor import DEAD_STATES, GONE, process_state

if TYPE_CHECKING:  # the store imports torch (2 s): the agent starts its command first
    from wanka.control.store import ControlStore

log = logging.getLogger("wanka.control.agent")
DUMP_BUDGET_S = 3.0  # a hang's stack dump before the kill: at most this long
STUCK_S = 30.0  # a poll under way this long (no orphan_s given): the store is said not to answer


class _Background(threading.Thread):
    """fn() on a daemon thread; `error` is what it raised, if anything."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(name="wanka-agent-poll", daemon=True)
        self.fn, self.error = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001  (re-raised by run_until, in its thread)
            self.error = e


class NodeAgent:
    def __init__(self, store: ControlStore, node: str, hb_dir: Path, poll_s: float = 0.5,
                 pgid: int | None = None, kill: Callable[[int, int], None] = os.killpg,
                 attempt: int | None = None, orphan_s: float | None = None,
                 stacks_dir: Path | None = None) -> None:  # fmt: skip
        """`pgid`: the process group to kill on "stop" (set it again for each attempt's
        torchrun); `kill(pgid, signal)` is os.killpg unless a test injects its own.
        `attempt`: only decisions about this attempt are carried out (None: any decision
        written after this agent started). `orphan_s`: with the store unreachable that long
        (its host, the coordinator's, is gone or cut off), stop the node's ranks on our own:
        nobody is left to name a fault or decide, and peers elsewhere may already be gone.
        `stacks_dir`: where a stop that asks for them (a hang) leaves this node's ranks' stacks
        (stacks-attemptN-NODE.txt; Python stacks in each rank's log without py-spy)."""
        self.store, self.node, self.hb_dir, self.poll_s = store, node, Path(hb_dir), poll_s
        self.pgid, self.kill, self.attempt, self.orphan_s = pgid, kill, attempt, orphan_s
        self.fenced = False
        self.stacks_dir = stacks_dir
        self._beats: dict[int, object] = {}  # rank -> its last Beat (for a stack dump)
        self._sent: dict[int, bytes] = {}  # rank -> the record + state last published
        self._exits_sent: dict[int, tuple] = {}
        self._marks_sent: set[int] = set()  # chaos marks (fault ids) published
        self._pids: dict[int, tuple[int, int]] = {}  # rank -> (pid, attempt) of its record
        store.register_node(node)
        # Without an attempt to match, a stop written before this agent started (an earlier
        # attempt's) must not kill the torchrun it was just given.
        old = store.read_decision() if attempt is None else None
        self._done_seq = old["seq"] if old else 0

    def poll_once(self) -> dict | None:
        """One look and one report; returns the decision carried out, if any."""
        # States are read first and published last, exit marks in between: a rank writes its
        # mark before it exits, so a rank published as gone has its mark in the store already
        # and the coordinator never takes an exit on purpose (a user error) for a crash.
        ranks = self._read_ranks()
        self._publish_exits({r: beat.attempt for r, (_, beat, _) in ranks.items()})
        self._publish_chaos_marks()
        self._publish_ranks(ranks)
        self.store.beat_agent(self.node, self.poll_s)
        return self._follow_decision()

    def run_until(self, stop: threading.Event) -> None:
        """Poll until `stop` is set. A store that stops answering is said once, not per poll:
        the ranks keep running (the coordinator sees this node's beats stop), until orphan_s
        without an answer, when the agent stops them itself. Each poll runs on a thread of its
        own: a store that accepts but never answers (frozen, SIGSTOPped) blocks a call far
        longer than torch's time-out, and must not keep the agent from fencing its node."""
        failing, last_ok, call = False, time.monotonic(), None
        quiet_s = self.orphan_s if self.orphan_s is not None else STUCK_S
        while not stop.is_set():
            if call is None:  # one poll at a time: a stuck one is waited on, never doubled
                call = _Background(self.poll_once)
            call.join(self.poll_s)
            error = None
            if not call.is_alive():
                error, call = call.error, None
                if error is None:
                    failing, last_ok = False, time.monotonic()
                    stop.wait(self.poll_s)
                    continue
                if not isinstance(error, ConnectionError):
                    raise error
            elif time.monotonic() - last_ok > quiet_s:
                host, port = getattr(self.store, "host", "?"), getattr(self.store, "port", "?")
                error = ConnectionError(f"the control store at {host}:{port} has not answered "
                                        f"for {quiet_s:.0f} s")  # fmt: skip
            if error is not None:
                if not failing:
                    log.error("agent %s: %s", self.node, error)
                failing = True
                # From the last answer, not the first error: a call into a silent link takes
                # the store's whole time-out before it fails.
                if self.orphan_s is not None and time.monotonic() - last_ok > self.orphan_s:
                    self._fence()
                if call is None:
                    stop.wait(self.poll_s)

    def _fence(self) -> None:
        """Stop this node's ranks: the store has been gone for orphan_s (once)."""
        if self.fenced or self.pgid is None:
            return
        self.fenced = True
        log.error("agent %s: the control store has been unreachable for %.0f s: stopping this "
                  "node's ranks", self.node, self.orphan_s)  # fmt: skip
        try:
            self.kill(self.pgid, signal.SIGKILL)
        except OSError:
            pass
        self._kill_ranks()
        if self.kill is os.killpg:  # and ranks still starting (no record yet, own sessions)
            from wanka.resilience.monitor import kill_marked

            kill_marked(f"WANKA_HB_DIR={self.hb_dir}")

    # -- one poll ----------------------------------------------------------------------------
    def _read_ranks(self) -> dict[int, tuple[bytes, object, str]]:
        """rank -> (record, Beat, process state) of every local rank with a whole record."""
        out = {}
        for rank, path in _rank_files(self.hb_dir, ".hb"):
            raw = _read_record(path)
            beat = _unpack(raw, rank) if raw is not None else None
            if beat is None:
                continue  # absent or torn: the next poll reads it whole
            self._pids[rank] = (beat.pid, beat.attempt)
            self._beats[rank] = beat
            out[rank] = (raw, beat, process_state(beat.pid) or GONE)
        return out

    def _publish_ranks(self, ranks: dict[int, tuple[bytes, object, str]]) -> None:
        """Publish every rank whose record or state changed."""
        for rank, (raw, _, state) in ranks.items():
            value = raw + state.encode()
            if self._sent.get(rank) != value:
                self.store.publish_rank(rank, raw, self.node, state)
                self._sent[rank] = value

    def _publish_exits(self, attempts: dict[int, int]) -> None:
        for rank, _ in _rank_files(self.hb_dir, ".exit"):
            code = exit_code(self.hb_dir, rank)
            if code is None:
                continue
            said = (code, exit_message(self.hb_dir, rank) or "", attempts.get(rank, self.attempt))
            if self._exits_sent.get(rank) != said:
                self.store.report_exit(rank, said[0], said[1], self.node, said[2])
                self._exits_sent[rank] = said

    def _publish_chaos_marks(self) -> None:
        """A drill's inside faults (nan, slow) mark HB_DIR/chaos/ID.fired when they fire."""
        folder = self.hb_dir / "chaos"
        for p in folder.glob("*.fired") if folder.is_dir() else ():
            if not p.stem.isdigit() or int(p.stem) in self._marks_sent:
                continue
            try:
                t = p.stat().st_mtime
            except OSError:
                continue
            self.store.report_chaos(int(p.stem), t, self.node)
            self._marks_sent.add(int(p.stem))

    def _follow_decision(self) -> dict | None:
        d = self.store.read_decision()
        if d is None or d["seq"] <= self._done_seq:
            return None
        self._done_seq = d["seq"]
        if self.attempt is not None and d["attempt"] != self.attempt:
            return None  # about another attempt than the one this node runs
        if d["action"] != "stop":
            detail = f"unknown action {d['action']!r}: ignored"
        elif self.pgid is None:
            detail = "no process group to stop"
        else:
            if d.get("dump") and self.stacks_dir is not None:
                self._dump_stacks(d["attempt"])
            try:
                self.kill(self.pgid, signal.SIGKILL)  # no grace: peers would wait on gloo
                detail = f"killed process group {self.pgid}"
                self._kill_ranks()
            except ProcessLookupError:
                detail = f"process group {self.pgid} was already gone"
            except OSError as e:  # said to the coordinator, which decides what next
                detail = f"could not kill process group {self.pgid}: {e}"
        log.info("agent %s: %s (%s)", self.node, detail, d.get("reason", ""))
        self.store.report_done(self.node, d, detail)
        return d

    def _dump_stacks(self, attempt: int) -> None:
        """This node's ranks' stacks before they are killed (a hang: where each one waits),
        for at most DUMP_BUDGET_S: a stop must not wait on py-spy (seconds per rank), and
        this poll runs under the control store's deadline."""
        from wanka.resilience.monitor import dump_stacks

        beats = {r: b for r, b in self._beats.items()
                 if self.attempt is None or b.attempt == self.attempt}  # fmt: skip
        out = self.stacks_dir / f"stacks-attempt{attempt}-{self.node}.txt"
        cancel = threading.Event()

        def dump() -> None:
            try:
                dump_stacks(beats, out, cancel=cancel)
            except OSError as e:
                log.error("agent %s: stacks not written: %s", self.node, e)

        t = threading.Thread(target=dump, name="wanka-stacks", daemon=True)
        t.start()
        t.join(DUMP_BUDGET_S)
        cancel.set()  # the kill follows: no rank is looked at after it

    def _kill_ranks(self) -> None:
        """torchrun starts each rank in a session of its own: killing its group leaves them.
        Only pids of this attempt's records: an older record's pid may be reused."""
        for pid, attempt in list(self._pids.values()):  # a stuck poll may still add some
            if self.attempt is not None and attempt != self.attempt:
                continue
            if (process_state(pid) or GONE) in DEAD_STATES:
                continue  # exited: its pid may already be another process's
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _unpack(raw: bytes, rank: int):
    from wanka.control.store import unpack_record

    return unpack_record(raw, rank)


def _rank_files(hb_dir: Path, suffix: str) -> list[tuple[int, Path]]:
    """(rank, path) of hb_dir/rank{N}{suffix}, as heartbeat.read_all finds them."""
    out = []
    for p in hb_dir.glob(f"rank*{suffix}") if hb_dir.is_dir() else ():
        n = p.name.removeprefix("rank").removesuffix(suffix)
        if n.isdigit():
            out.append((int(n), p))
    return sorted(out)


def _read_record(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(RECORD_SIZE)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wanka.control.agent", description=__doc__)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--store-from-orders", action="store_true",
                   help="read the launcher's orders (one JSON line) on stdin first and take the "
                   "store's address from their 'store' entry; the rest goes to the command")  # fmt: skip
    p.add_argument("--job", required=True)
    p.add_argument("--node", default=os.environ.get("WANKA_NODE") or os.uname().nodename)
    p.add_argument("--hb-dir", type=Path, required=True)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--pgid", type=int, default=None, help="process group to kill on stop")
    p.add_argument("--attempt", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=30.0, help="to reach the store")
    p.add_argument(
        "--orphan-s",
        type=float,
        default=None,
        help="store unreachable this long: stop the node's ranks (default: never)",
    )
    p.add_argument("--stacks-dir", type=Path, default=None,
                   help="a stop for a hang writes this node's ranks' stacks here first")  # fmt: skip
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...: start and watch it")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.store_from_orders and not cmd:
        p.error("--store-from-orders needs a command (-- CMD ...) to pass the orders to")
    if not a.store_from_orders and (a.host is None or a.port is None):
        p.error("--host and --port are required (or --store-from-orders)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The command starts first: its own start-up overlaps the agent's (torch for the store).
    pipe = subprocess.PIPE if a.store_from_orders else None
    child = subprocess.Popen(cmd, process_group=0, stdin=pipe) if cmd else None
    try:
        from wanka.control.store import ControlStore

        host, port = a.host, a.port
        if a.store_from_orders:
            # A warm launcher does not know which store its attempt will use until its orders
            # come: it never beats before them, and no store's loss makes it useless.
            found = _forward_orders(child)
            if found is None:  # dismissed (end of input before any orders)
                return child.wait()
            host, port = found
        from wanka.control.store import call_within

        store = ControlStore.connect(host, port, a.job, a.timeout_s)
        agent = call_within(  # it registers: a store that accepts but never answers fails too
            lambda: NodeAgent(store, a.node, a.hb_dir, a.poll_s, a.pgid, attempt=a.attempt,
                              orphan_s=a.orphan_s, stacks_dir=a.stacks_dir),
            a.timeout_s,
            f"the control store at {host}:{port} did not answer within {a.timeout_s:.0f} s",
        )  # fmt: skip
    except ConnectionError as e:
        print(f"wanka agent {a.node}: {e}", file=sys.stderr)
        if child is not None:  # never left running unwatched
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        return 1
    stop = threading.Event()
    if child is not None:
        return run_command(agent, child, stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.run_until(stop)
    return 0


def _forward_orders(child: subprocess.Popen) -> tuple[str, int] | None:
    """Read the orders line on our stdin, pass it on to `child` without its "store" entry,
    and return that store's (host, port); None at the end of input (the child is told so by
    the end of its own input). Bad orders raise ConnectionError: nothing to report to."""
    line = sys.stdin.readline()
    if not line.strip():
        child.stdin.close()
        return None
    try:
        orders = json.loads(line)
        store = orders.pop("store")
        host, port = str(store["host"]), int(store["port"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConnectionError(f"orders without a usable 'store' entry ({e})") from None
    try:
        child.stdin.write((json.dumps(orders) + "\n").encode())
        child.stdin.close()
    except OSError:  # it died meanwhile: run_command sees it exit
        pass
    return host, port


def run_command(agent: NodeAgent, child: subprocess.Popen, stop: threading.Event) -> int:
    """Watch `child` (started in its own process group) until it exits."""
    agent.pgid = child.pid

    def forward(sig: int, _frame) -> None:
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    threading.Thread(target=lambda: (child.wait(), stop.set()), daemon=True).start()
    agent.run_until(stop)
    try:  # the ranks' last records and exit marks; never waiting on a store that is stuck
        from wanka.control.store import call_within

        limit = agent.orphan_s if agent.orphan_s is not None else STUCK_S
        call_within(agent.poll_once, limit, "the control store did not take the last report")
    except ConnectionError as e:
        log.error("agent %s: %s", agent.node, e)
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    from wanka.process_exit import exit_now

    exit_now(main())  # the supervisor waits for the agent to be gone
