"""The coordinator: finds the job's faults from the control store alone and writes decisions.

It never reads a heartbeat file or /proc: what it knows of a rank is what that rank's node agent
published (record, process state, exit mark). The rules are the supervisor's (resilience/
supervisor.py, resilience/monitor.py), moved off the shared filesystem:

* node_lost: an agent whose beat counter has not advanced for its ranks' hang limit (at most
  `agent_timeout_s`, and that while it has no rank past start-up), timed on the coordinator's
  own clock (a counter, not a timestamp, so no two hosts' clocks are compared).
  A node whose ranks all reached `done` is not lost when its agent goes quiet.
  Its ranks are not blamed separately: what they last published is stale, not wrong.
* process_crash (startup_failure before step 1), user_error, preempted: a rank whose process
  is gone or a zombie out of the `done` phase, or that reported a non-zero exit. The culprit is
  a rank that was killed; ranks that exited with an error usually died of losing it.
* hang: monitor.py's learned per-phase limits, and its culprit: a stopped (T) or
  uninterruptible (D) rank if there is one, else the one that stopped making progress first.

While any agent is late (a few polls without a beat) no crash or hang is named: a host going
down stalls or breaks the ranks of every other host, and the cause is that host. For the same
reason a death is named only once every node's agent has beaten twice since it was first seen
(a peer's rank dies of a reset connection at once, before its silence could show): ~2 polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from wanka.control.store import DEAD_STATES, ControlStore, ExitReport, RankReport
from wanka.resilience.heartbeat import phase_words
from wanka.resilience.monitor import UNWATCHED, Hang, HangMonitor, Timeouts, user_code_fault

# The supervisor's exit codes (resilience/supervisor.py), not imported from there: the
# supervisor is to import this module, and the cycle would break at import time.
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75
LATE_POLLS = 3  # an agent this many polls behind may be going down: hold verdicts back
LATE_MIN_S = 1.0


@dataclass(frozen=True)
class ControlFault:
    cause: str  # process_crash, startup_failure, user_error, preempted, hang, node_lost
    rank: int | None
    node: str | None
    detail: str  # worded as the supervisor words it for the ledger and the timeline
    t_fault: float | None = None  # when it happened as far as known, on the coordinator's clock
    state: str | None = None  # the culprit rank's process state, as its node saw it
    limit_s: float | None = None  # the learned hang limit it was detected within

    def onto(self, out, now: float, t_fault: float | None = None) -> None:
        """Copy this fault into the supervisor's Outcome `out`, detected `now` (`t_fault`:
        when it happened if known better, e.g. a drill's injection)."""
        out.cause, out.rank, out.node, out.detail = self.cause, self.rank, self.node, self.detail
        out.t_fault, out.t_detect = t_fault or self.t_fault or now, now
        out.limit_s = self.limit_s

    def describe(self) -> str:
        where = (
            f"node {self.node}" if self.rank is None else f"rank {self.rank} on node {self.node}"
        )
        return f"{where}: {self.cause} ({self.detail})"


class Coordinator:
    def __init__(self, store: ControlStore, world_size: int, timeouts: Timeouts,
                 agent_timeout_s: float = 10.0, attempt: int | None = None,
                 nodes: list[str] | None = None, home: str | None = None,
                 expect_s: float | None = None,
                 witness: Callable[[], tuple[str, bool] | None] | None = None) -> None:  # fmt: skip
        """`attempt`: only heartbeats and exits of that attempt count (the store outlives
        attempts; None: all). Set `.attempt` again when the next attempt starts. `nodes`: the
        nodes of the attempt (None: every node registered); other agents (a spare started
        ahead for a node evicted since) are not watched. `home`: the node the store runs on.
        `expect_s`: a node of `nodes` whose agent has not joined this long after now is lost
        (a host planned for the attempt that went before it began). `witness()`: (a node
        outside the attempt, whether it reaches the store now), or None without one: with a
        single other node, it tells a cut link of the store's node from that node's loss."""
        self.store, self.world_size, self.timeouts = store, world_size, timeouts
        self.nodes = None if nodes is None else set(nodes)
        self.agent_timeout_s, self.attempt, self.home = agent_timeout_s, attempt, home
        self.monitor = HangMonitor(timeouts)
        self.expect_s, self._t0 = expect_s, time.time()
        self.witness = witness
        # node -> (beat counter, when it last advanced on our clock, the agent's poll period)
        self._heard: dict[str, tuple[int, float, float]] = {}
        # node -> that host's clock minus ours, as of its last beat (underestimated by the
        # delay before we saw it: a stall is never overstated by clock skew)
        self._offset: dict[str, float] = {}
        self._counts_at_death: dict[str, int] | None = None  # agents' counters when first seen

    def check(self, now: float | None = None, final: bool = False) -> ControlFault | None:
        """One look at the store; the fault to act on, or None. `final`: the attempt has ended
        (a launcher exited): name a death without waiting for more beats (the supervisor tells
        a node that went from its launcher's exit)."""
        now = time.time() if now is None else now
        agents = self.store.read_agents()
        for node in self.store.nodes():
            if self.nodes is not None and node not in self.nodes:
                continue
            beat = agents.get(node)
            count, poll_s = (beat.count, beat.poll_s) if beat else (0, 0.0)
            heard = self._heard.get(node)
            if heard is None or heard[0] != count:
                self._heard[node] = (count, now, poll_s)
                if beat is not None:
                    self._offset[node] = beat.t - now
        if (never := self._never_joined(now)) is not None:
            return never
        ranks = {r: rep for r, rep in self.store.read_ranks(self.world_size).items()
                 if self._current(rep.beat.attempt)}  # fmt: skip
        finished = _finished(ranks)
        lost = self._lost(now, finished, ranks)
        if lost is not None:
            return lost
        exits = {r: e for r, e in self.store.read_exits(self.world_size).items()
                 if e.attempt is None or self._current(e.attempt)}  # fmt: skip
        self.timeouts.observe(rep.beat for rep in ranks.values())
        if self._any_late(now, finished):
            return None
        died = self._exited(ranks, exits, now)
        if died is None:
            self._counts_at_death = None
            return self._hung(ranks, now)
        if final or self._every_node_beat_since(finished, died.node):
            return died
        return None

    def decide_stop(self, attempt: int, reason: str, dump: bool = False) -> dict:
        """Tell every agent to kill its ranks (`dump`: after writing their stacks, a hang's
        evidence); returns the decision as written."""
        return self.store.write_decision("stop", attempt, reason, dump=dump)

    # -- the rules ---------------------------------------------------------------------------
    def _never_joined(self, now: float) -> ControlFault | None:
        if self.expect_s is None or not self.nodes or now - self._t0 <= self.expect_s:
            return None
        missing = sorted(self.nodes - set(self.store.nodes()))
        if not missing:
            return None
        detail = (f"planned for this attempt, its agent never joined it in {self.expect_s:.0f} s "
                  "(the host went, or its supervisor stopped)")  # fmt: skip
        return ControlFault("node_lost", None, missing[0], detail, t_fault=self._t0,
                            limit_s=self.expect_s)  # fmt: skip

    def _current(self, attempt: int) -> bool:
        return self.attempt is None or attempt == self.attempt

    def _lost(self, now: float, finished: set[str],
              ranks: dict[int, RankReport]) -> ControlFault | None:  # fmt: skip
        silent = {n: now - t for n, (_, t, _) in self._heard.items() if n not in finished}
        over = {n: s for n, s in silent.items() if s > self._silence_limit(n, ranks)}
        if not over:
            return None
        cut = self._home_cut_off(now, silent)
        if cut is not None:
            return cut
        node = max(over, key=lambda n: silent[n])  # the first to go quiet
        detail = (f"agent silent for {silent[node]:.1f} s, limit "
                  f"{self._silence_limit(node, ranks):.1f} s")  # fmt: skip
        return ControlFault("node_lost", None, node, detail, t_fault=self._heard[node][1],
                            limit_s=self._silence_limit(node, ranks))  # fmt: skip

    def _home_cut_off(self, now: float, silent: dict[str, float]) -> ControlFault | None:
        """Every other node went quiet at once while the store's own node still beats (or
        trains no rank: a hot spare): the store's node is the one cut off (its agent reaches
        the store inside the node, as we do). Needs two other nodes or more: with one, either
        side of a partition looks the same."""
        home = self.home
        others = [n for n in silent if n != home]
        if home is None or not others or (home in silent and self._late(home, now)):
            return None
        if len(others) == 1:  # either side of a partition of two looks the same: ask a third
            return self._witnessed_cut(others[0], now)
        if not all(self._late(n, now) for n in others):
            return None
        # A cut link silences every other node at one moment (within a poll or two); nodes
        # that died one after the other are each their own fault.
        last = [self._heard[n][1] for n in others]
        if max(last) - min(last) > LATE_MIN_S:
            return None
        quiet = min(silent[n] for n in others)
        beat = "while its own agent beat" if home in silent else "at once"
        detail = (f"the control store on it was unreachable from every other node "
                  f"({', '.join(sorted(others))}) for {quiet:.1f} s {beat}: its link is cut")  # fmt: skip
        return ControlFault("node_lost", None, home, detail,
                            t_fault=max(self._heard[n][1] for n in others),
                            limit_s=self.agent_timeout_s)  # fmt: skip

    def _witnessed_cut(self, other: str, now: float) -> ControlFault | None:
        """One other node silent while the store's node beats: the store's node cut off if a
        node outside the attempt (a hot spare) cannot reach the store either."""
        if self.witness is None or not self._late(other, now):
            return None
        seen = self.witness()
        if seen is None or seen[1]:
            return None  # no witness, or it reaches the store: the silent node is the one
        detail = (f"the control store on it was unreachable from {other} and from {seen[0]} "
                  "(a node outside the attempt) while its own agent beat: its link is cut")  # fmt: skip
        return ControlFault("node_lost", None, self.home, detail, t_fault=self._heard[other][1],
                            limit_s=self.agent_timeout_s)  # fmt: skip

    def _late(self, node: str, now: float) -> bool:
        _, t, poll_s = self._heard[node]
        return now - t > max(LATE_POLLS * poll_s, LATE_MIN_S)

    def _silence_limit(self, node: str, ranks: dict[int, RankReport]) -> float:
        """How long a node's agent may be silent: its ranks' own hang limits (a host that went
        is found as soon as its ranks' hang would have been), at most `agent_timeout_s`, the
        limit too while the node has no rank in a watched phase (start-up)."""
        limits = [self.monitor.limit(rep.beat) for rep in ranks.values()
                  if rep.node == node and rep.beat.phase not in UNWATCHED]  # fmt: skip
        if not limits:
            return self.agent_timeout_s
        return min(self.agent_timeout_s, max(self.timeouts.floor, *limits))

    def _every_node_beat_since(self, finished: set[str], own: str | None) -> bool:
        """Every other unfinished node's agent has beaten twice since a death was first seen,
        so its node was up after it (one beat may have been written just before its host
        went). The dead rank's own node reported the death: it was up."""
        counts = {n: c for n, (c, _, _) in self._heard.items() if n not in finished and n != own}
        if self._counts_at_death is None:
            self._counts_at_death = counts
        seen = self._counts_at_death
        return all(c >= seen[n] + 2 for n, c in counts.items() if n in seen)

    def _any_late(self, now: float, finished: set[str]) -> bool:
        return any(self._late(n, now) for n in self._heard if n not in finished)

    def _exited(self, ranks: dict[int, RankReport], exits: dict[int, ExitReport],
                now: float) -> ControlFault | None:  # fmt: skip
        said = {r: e for r, e in exits.items() if e.code != 0}
        dead = set(said) | {
            r for r, rep in ranks.items() if rep.state in DEAD_STATES and rep.beat.phase != "done"
        }
        if not dead:
            return None
        codes = {said[r].code for r in dead if r in said}
        if EXIT_USER_ERROR in codes:  # it said why; retrying cannot help
            rank = min(r for r in dead if r in said and said[r].code == EXIT_USER_ERROR)
            cause = "user_error"
        elif EXIT_PREEMPTED in codes:
            rank = min(r for r in dead if r in said and said[r].code == EXIT_PREEMPTED)
            cause = "preempted"
        else:
            rank = min(dead, key=lambda r: (r in said, r))
            cause = "process_crash"
        rep, exit_ = ranks.get(rank), said.get(rank)
        how = f"exit {exit_.code}" if exit_ else f"process {rep.state}" if rep else "exited"
        if exit_ and exit_.message:
            how += f": {exit_.message}"
        if rep is None:
            detail = f"rank {rank} died, {how}"
        elif rep.beat.step < 0 and cause == "process_crash":
            cause = "startup_failure"
            detail = f"rank {rank} died while starting ({rep.beat.phase}), {how}"
        else:
            where = phase_words(rep.beat.phase)
            detail = f"rank {rank} died in {where} of step {rep.beat.step + 1}, {how}"
            cause = user_code_fault(cause, rep.beat.phase)
        node = rep.node if rep else exit_.node if exit_ else None
        return ControlFault(cause, rank, node, detail, t_fault=now,
                            state=rep.state if rep else None)  # fmt: skip

    def _hung(self, ranks: dict[int, RankReport], now: float) -> ControlFault | None:
        def since(rep: RankReport) -> float:  # when it entered its phase, on our clock
            return rep.beat.since - self._offset.get(rep.node, 0.0)

        live = [rep for rep in ranks.values() if rep.beat.phase not in UNWATCHED]
        over = [rep for rep in live if now - since(rep) > self.monitor.limit(rep.beat)]
        if not over:
            return None
        stuck = [rep for rep in live if rep.state in ("T", "t", "D")]
        c = min(stuck or live, key=lambda rep: (rep.beat.step, since(rep)))
        hang = Hang(c.beat.rank, c.beat.phase, c.beat.step, since(c), now - since(c),
                    self.monitor.limit(c.beat), c.state)  # fmt: skip
        cause = user_code_fault("hang", c.beat.phase)
        return ControlFault(cause, c.beat.rank, c.node, hang.describe(), t_fault=since(c),
                            state=c.state, limit_s=hang.limit_s)  # fmt: skip


def _finished(ranks: dict[int, RankReport]) -> set[str]:
    """The nodes whose ranks all reached `done`: their agents end with them, so their
    silence is no fault."""
    working = {rep.node for rep in ranks.values() if rep.beat.phase != "done"}
    return {rep.node for rep in ranks.values()} - working
