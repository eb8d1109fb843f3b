"""`search`: offline exploration of a task's variant space, like an autotuner.

Strategy: evolutionary local search with a per-value bandit.
- The first proposal is the baseline's point of the space (the seed).
- Afterwards, with probability `explore` (or while nothing is correct yet) a fresh point is
  drawn; otherwise a parent is picked by tournament among the fastest correct candidates
  and mutated in one or two knobs: ordered knobs (chunk sizes, warps) step to a neighbour,
  unordered ones (algorithms, layouts) jump to another value.
- Every value choice is a Thompson draw: Beta(correct + 1, failed + 1) for "this value
  works", scaled by the geometric-mean speedup of the correct candidates that used it, so
  values that keep failing (e.g. a precision the tolerance rejects) or lose fade out.
- Points are canonicalised (knobs that do not matter under a config are fixed), and a point
  already in the history is never proposed again: every evaluation of the budget is new.
  When mutations keep landing on known points, it roams uniformly; a sweep of whatever is
  left is the last resort (small spaces get enumerated completely).
The random stream is seeded by (seed, history length): a resumed run proposes as a fresh
run with the same history would.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import defaultdict

from wanka.lab.proposers.base import Proposal, Proposer
from wanka.lab.store import Record
from wanka.lab.task import Knob, LabError, Task, VariantSpace


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


class SearchProposer(Proposer):
    name = "search"

    def __init__(self, seed: int = 0, explore: float = 0.2, elite: int = 6, tournament: int = 3):
        self.seed, self.explore, self.elite, self.tournament = seed, explore, elite, tournament

    def propose(self, task: Task, history: list[Record]) -> Proposal | None:
        space = task.space
        if space is None:
            raise LabError(f"task {task.name} declares no variant space for the search proposer")
        rng = random.Random(self.seed * 1_000_003 + len(history))
        seen = {_key(space.canonical(r.config)) for r in history if r.config}
        base = space.canonical(space.baseline)
        if _key(base) not in seen:
            return Proposal(space.render(base), base, "baseline point (seed)")
        stats = _value_stats(space, history)
        good = sorted((r for r in history if r.correct and r.speedup and r.config),
                      key=lambda r: -r.speedup)[: self.elite]  # fmt: skip
        for attempt in range(300):
            if attempt >= 100:  # the neighbourhood of the elite is used up: roam uniformly
                cfg, note = {k.name: rng.choice(k.values) for k in space.knobs}, "explore (uniform)"
            elif not good or rng.random() < self.explore:
                cfg, note = self._fresh(space, stats, rng), "explore"
            else:
                parent = min(rng.sample(good, min(self.tournament, len(good))),
                             key=lambda r: -r.speedup)  # fmt: skip
                cfg = self._mutate(space, parent.config, stats, rng)
                note = f"mutation of #{parent.n} ({parent.speedup:.2f}x)"
            cfg = space.canonical(cfg)
            if _key(cfg) not in seen:
                return Proposal(space.render(cfg), cfg, note)
        for combo in itertools.product(*(k.values for k in space.knobs)):  # sweep what is left
            cfg = space.canonical(dict(zip([k.name for k in space.knobs], combo)))
            if _key(cfg) not in seen:
                return Proposal(space.render(cfg), cfg, "sweep (random proposals exhausted)")
        return None

    def _score(self, stats, knob: Knob, value, rng: random.Random) -> float:
        ok, bad, logs = stats[(knob.name, _key(value))]
        speed = math.exp(sum(logs) / len(logs)) if logs else 1.0
        return rng.betavariate(ok + 1, bad + 1) * speed

    def _pick(self, stats, knob: Knob, values, rng: random.Random):
        return max(values, key=lambda v: self._score(stats, knob, v, rng))

    def _fresh(self, space: VariantSpace, stats, rng: random.Random) -> dict:
        return {k.name: self._pick(stats, k, k.values, rng) for k in space.knobs}

    def _mutate(self, space: VariantSpace, parent: dict, stats, rng: random.Random) -> dict:
        cfg = dict(parent)
        for _ in range(1 if rng.random() < 0.6 else 2):
            knobs = [k for k in space.knobs if k.relevant(cfg) and len(k.values) > 1]
            for _ in range(4):  # a jump the bandit finds much worse: try another knob
                kn = rng.choice(knobs)
                if kn.ordered:
                    i = kn.values.index(cfg[kn.name]) if cfg[kn.name] in kn.values else 0
                    step = rng.choice((-1, 1)) * (2 if rng.random() < 0.2 else 1)
                    cfg[kn.name] = kn.values[min(max(i + step, 0), len(kn.values) - 1)]
                    break
                others = [v for v in kn.values if v != cfg[kn.name]]
                new = self._pick(stats, kn, others, rng)
                if self._score(stats, kn, new, rng) >= 0.5 * self._score(
                    stats, kn, cfg[kn.name], rng
                ):
                    cfg[kn.name] = new
                    break
        return cfg


def _value_stats(space: VariantSpace, history: list[Record]):
    """(knob, value) -> [correct count, failed count, log speedups of the correct ones]."""
    stats: dict = defaultdict(lambda: [0, 0, []])
    for r in history:
        if not r.config:
            continue
        cfg = space.canonical(r.config)
        for k in space.knobs:
            if not k.relevant(cfg):
                continue
            s = stats[(k.name, _key(cfg[k.name]))]
            if r.correct:
                s[0] += 1
                if r.speedup:
                    s[2].append(math.log(r.speedup))
            else:
                s[1] += 1
    return stats
