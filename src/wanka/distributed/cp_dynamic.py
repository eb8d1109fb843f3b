"""Dynamic context-parallel placement: which rank holds which piece of which document.

Input: the lengths of all document fragments of one step, over the whole dp x cp world.
Output: pieces (rank, doc, start, end), with global rank = dp_rank * cp + cp_rank.

Greedy longest-processing-time first on modelled cost (``CostModel``), run world-wide and
within each dp group's own rows; the plan with the lower maximum is kept (``assign_dynamic``):

1. Documents are taken largest cost first. One stays whole on the least-loaded rank that has
   token room (any rank of any dp group) when that keeps the rank within
   ``(1 + tolerance) * mean`` cost: a whole document needs no key/value exchange.
2. Otherwise it is split over the ranks of ONE block of ``span`` ranks (a CP group at first):
   the block whose ranks it can be water-filled onto at the lowest level, preferring blocks
   that already exchange keys (so the others can skip the all-gather). Each rank gets a front
   chunk and a back chunk (head-tail) whose modelled cost meets its water-filled share; cut by
   cost, not by tokens, because DSA's min(p + 1, topk) makes a document's first topk positions
   cheap. Three cuts are tried and the one with the lower maximum kept: equal-token chunks,
   equally long pairs cut to cost, and pairs of unequal length that keep each rank's token
   share exactly and match its cost (what works when the token budget binds).

3. When the busiest rank is still more than 2% above the mean and some document costs more
   than the mean even spread over a CP group (e.g. a long document in one dp group's rows,
   short ones in the others'), the plan is redone with blocks of 2 cp,
   4 cp, ... ranks (up to ``max_span``, default 4 cp); a wider plan is kept when its modelled
   step (including the bigger gather) is 1% or more below the best narrower one: the gather
   group is chosen per step (``span``).

The maximum lands near ``(1 + tolerance) * mean`` by construction: a pass that moved or
swapped whole documents between the most and least loaded ranks afterwards gained < 0.1%
(the top rank rarely holds a document smaller than the gap), so there is none.

Every rank stays within ``max_tokens`` (memory): whole placement only uses ranks with room
and splits cap each rank's share at its room, so a document that fits nowhere whole is split.
Deterministic: stable sorts and first-index tie breaks only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from wanka.distributed.cp_cost import CostModel

# Widest gather block by default, in CP groups: each width tried costs a planning pass, and a
# block's gather holds span x lmax tokens of keys on every rank of it.
DEFAULT_SPAN_FACTOR = 4


class PlanError(ValueError):
    pass


@dataclass
class _State:
    dp: int
    cp: int
    max_tokens: int
    load: np.ndarray  # [dp * cp] modelled cost per rank
    tokens: np.ndarray  # [dp * cp] tokens per rank
    gathering: np.ndarray  # [dp] groups that already hold a split document
    heap: list[tuple[float, int]]  # (load, rank); an entry is stale once the load changed
    pieces: list[np.ndarray] = field(default_factory=list)  # [k, 4] rank, doc, start, end

    def add(self, rank: int, cost: float, tokens: int) -> None:
        self.load[rank] += cost
        self.tokens[rank] += tokens
        heapq.heappush(self.heap, (float(self.load[rank]), rank))

    def keep_whole(self, rank: int, doc: int, n: int, cost: float) -> None:
        self.pieces.append(np.array([[rank, doc, 0, n]]))
        self.add(rank, cost, n)

    def place_split(self, doc: int, ranks: np.ndarray, cuts: np.ndarray, costs: np.ndarray) -> None:
        """Pieces [start, end) = cuts[i] of ``doc`` on ``ranks[i]``."""
        self.pieces.append(np.column_stack([ranks, np.full(len(ranks), doc), cuts]))
        for rank, c, t in zip(ranks.tolist(), costs.tolist(), (cuts[:, 1] - cuts[:, 0]).tolist()):
            self.add(rank, c, t)

    def least_loaded_with_room(self, n: int) -> int:
        """The least-loaded rank (lowest index on ties) with room for n more tokens, or -1."""
        skipped, found = [], -1
        while self.heap and len(skipped) < 32:
            load, rank = self.heap[0]
            if load != self.load[rank]:
                heapq.heappop(self.heap)
            elif self.tokens[rank] + n > self.max_tokens:
                skipped.append(heapq.heappop(self.heap))
            else:
                found = rank
                break
        if len(skipped) == 32:  # many ranks are full: one vector scan is cheaper
            ok = self.tokens + n <= self.max_tokens
            # (not argmin over inf-masked loads: with every load inf, that picks a full rank)
            found = int(np.flatnonzero(ok)[np.argmin(self.load[ok])]) if ok.any() else -1
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        return found


def _water_levels(loads: np.ndarray, c: float) -> np.ndarray:
    """Per group (row of loads), the level reached by pouring cost c onto its ranks."""
    srt = np.sort(loads, axis=1)
    m = np.arange(1, loads.shape[1] + 1)
    return np.min((c + np.cumsum(srt, axis=1)) / m, axis=1)


def _token_shares(loads: np.ndarray, rooms: np.ndarray, n: int, c: float) -> np.ndarray:
    """Integer tokens per rank (sum n, each <= room) that water-fill cost c onto loads."""
    per_token = c / n
    level = _water_levels(loads[None, :], c)[0]
    real = np.maximum(0.0, level - loads) / per_token
    if np.any(real > rooms):  # memory caps bind: find the level by bisection
        lo, hi = float(loads.min()), float(loads.max()) + (n + 1) * per_token
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if np.clip((mid - loads) / per_token, 0, rooms).sum() < n:
                lo = mid
            else:
                hi = mid
        real = np.clip((hi - loads) / per_token, 0, rooms)
    shares = np.minimum(np.floor(real).astype(np.int64), rooms)
    # Hand out the rounding remainder by largest fraction among ranks with room left.
    frac = real - shares
    while shares.sum() < n:
        open_ = np.flatnonzero(shares < rooms)
        for j in open_[np.argsort(-frac[open_], kind="stable")][: n - shares.sum()]:
            shares[j] += 1
        frac[:] = 0.0
    while shares.sum() > n:  # rounding past n (never by normal coefficients): take it back
        shares[np.argmax(shares)] -= 1
    return shares


def _head_tail_cuts(shares: np.ndarray, n: int) -> np.ndarray:
    """[group-local rank, start, end]: rank j gets a front chunk and the mirrored back chunk."""
    j = np.flatnonzero(shares)
    head = shares[j] // 2
    tail = shares[j] - head
    front = np.cumsum(head) - head  # front chunks from position 0 up, in rank order
    back = n - np.cumsum(tail)  # back chunks from n down, in the same order
    cuts = np.concatenate(
        [np.stack([j, front, front + head], 1), np.stack([j, back, back + tail], 1)]
    )
    return cuts[cuts[:, 2] > cuts[:, 1]]


def _cost_balanced_cuts(
    cost: CostModel, shares: np.ndarray, rooms: np.ndarray, n: int
) -> np.ndarray:
    """Like ``_head_tail_cuts``, but each rank's front + back pair is sized to the COST of its
    token share at the document's average cost per token, not to its token count.

    Equal token chunks balance a cost linear or quadratic in position (what head-tail is
    for), not DSA's min(p + 1, topk): at topk 2048 and 8k-token documents the first chunk
    costs about half of the others, and the rank holding it a seventh less than its peers. So
    ranks in order take a front chunk and an equally long back chunk whose modelled cost
    meets their target (bisection on the length, at most the rank's token room; what a room
    leaves undone is shared out over the ranks after it); the last takes the middle."""
    j = np.flatnonzero(shares)
    targets = shares[j] * (cost.piece_cost(0, n) / n)
    rows, a, e = [], 0, n
    for i, rank in enumerate(j.tolist()):
        if i == len(j) - 1:
            rows.append((rank, a, e))
            break
        left = cost.piece_cost(a, e)  # what the remaining ranks must take, shared as planned
        target = left * float(targets[i] / targets[i:].sum())
        lo, hi = 0, min((e - a) // 2, int(rooms[rank]) // 2)  # largest pair within target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost.piece_cost(a, a + mid) + cost.piece_cost(e - mid, e) <= target:
                lo = mid
            else:
                hi = mid - 1
        rows += [(rank, a, a + lo), (rank, e - lo, e)]
        a, e = a + lo, e - lo
    cuts = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return cuts[cuts[:, 2] > cuts[:, 1]]


def _share_matched_cuts(cost: CostModel, shares: np.ndarray, n: int) -> np.ndarray:
    """Like ``_cost_balanced_cuts``, but each rank keeps exactly its token share and gets its
    cost share too: its front and back chunks may differ in length.

    Under a token budget the equal-length pair cannot do both: the rank holding a document's
    first (cheap) topk positions reaches its cost share only past its token room (an 8k-token
    document over 4 ranks at a 10% budget: that rank at 0.88 of the mean, the others at 1.10).
    Here ranks in order take, of their share s, a front chunk of x tokens and a back chunk of
    s - x, x found by bisection: the cost falls as x grows (a front token sits at a lower
    position than the back token it replaces, and cost per token never falls with position),
    so the largest cost not above the share's cost at the document's mean cost per token is
    one search away. Every rank then takes that mean per token, so what is left keeps it and
    the next rank can match it too; the last takes the middle."""
    j = np.flatnonzero(shares)
    per_token = cost.piece_cost(0, n) / n
    rows, a, e = [], 0, n
    for i, rank in enumerate(j.tolist()):
        s = int(shares[rank])
        if i == len(j) - 1:
            rows.append((rank, a, e))
            break
        target = s * per_token
        lo, hi = 0, s  # smallest front length whose pair costs no more than the target
        while lo < hi:
            mid = (lo + hi) // 2
            if cost.piece_cost(a, a + mid) + cost.piece_cost(e - s + mid, e) <= target:
                hi = mid
            else:
                lo = mid + 1
        rows += [(rank, a, a + lo), (rank, e - s + lo, e)]
        a, e = a + lo, e - s + lo
    cuts = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return cuts[cuts[:, 2] > cuts[:, 1]]


def _split(state: _State, cost: CostModel, n: int, c: float, limit: float):
    """Best split over one CP group: (group, [group-local rank, start, end], their costs,
    the group's new max cost), or None when no group has room."""
    dp, cp = state.dp, state.cp
    loads = state.load.reshape(dp, cp)
    rooms = (state.max_tokens - state.tokens).reshape(dp, cp)
    levels = _water_levels(loads, c)
    levels[rooms.sum(axis=1) < n] = np.inf
    if not np.isfinite(levels).any():
        return None
    preferred = state.gathering & (levels <= limit)
    pool = np.where(preferred, levels, np.inf) if preferred.any() else levels
    g = int(np.argmin(pool))
    shares = _token_shares(loads[g], rooms[g], n, c)
    # Drop slivers (< 1/4 of an even share): each piece costs a segment and its gather.
    tiny = (shares > 0) & (shares < n / (4 * cp))
    if tiny.any() and rooms[g][~tiny].sum() >= n:
        shares = _token_shares(loads[g], np.where(tiny, 0, rooms[g]), n, c)
    best = None
    for cuts in (
        _head_tail_cuts(shares, n),
        _cost_balanced_cuts(cost, shares, rooms[g], n),
        _share_matched_cuts(cost, shares, n),
    ):
        held = np.bincount(cuts[:, 0], weights=cuts[:, 2] - cuts[:, 1], minlength=cp)
        if np.any(held > rooms[g]):  # the cost-balanced pairs moved tokens past a room
            continue
        piece_cost = cost.cost(cuts[:, 1], cuts[:, 2])
        new = float((loads[g] + np.bincount(cuts[:, 0], weights=piece_cost, minlength=cp)).max())
        if best is None or new < best[3]:
            best = (g, cuts, piece_cost, new)
    return best


def _greedy(
    lengths: np.ndarray, dp: int, cp: int, cost: CostModel, max_tokens: int, tolerance: float
) -> np.ndarray:
    """Pieces [rank, doc, start, end] (int64 [P, 4]) for documents of the given lengths."""
    ranks = dp * cp
    costs = cost.doc_cost(lengths).astype(np.float64)
    limit = (1 + tolerance) * costs.sum() / ranks
    state = _State(
        dp, cp, max_tokens, np.zeros(ranks), np.zeros(ranks, dtype=np.int64),
        np.zeros(dp, dtype=bool), [(0.0, r) for r in range(ranks)],
    )  # fmt: skip
    for doc in np.argsort(-costs, kind="stable").tolist():
        n, c = int(lengths[doc]), float(costs[doc])
        r = state.least_loaded_with_room(n)
        if r >= 0 and (cp == 1 or state.load[r] + c <= limit):
            state.keep_whole(r, doc, n, c)
            continue
        split = _split(state, cost, n, c, limit) if cp > 1 else None
        if split is None or (r >= 0 and split[3] >= state.load[r] + c):
            if r < 0:
                raise PlanError(
                    f"a document of {n} tokens fits on no rank (max_tokens_per_rank="
                    f"{max_tokens}, split over at most {cp} ranks): raise "
                    "max_tokens_per_rank or the slack"
                )
            state.keep_whole(r, doc, n, c)  # splitting would not lower the maximum
            continue
        g, cuts, piece_cost, _ = split
        state.gathering[g] = True
        state.place_split(doc, g * cp + cuts[:, 0], cuts[:, 1:], piece_cost)
    return np.concatenate(state.pieces).astype(np.int64)


def assign_dynamic(
    lengths: np.ndarray,
    group: np.ndarray,
    cp: int,
    cost: CostModel,
    max_tokens: int,
    tolerance: float = 0.01,
    max_span: int | None = None,
    widen_gain: float = 0.01,
) -> tuple[np.ndarray, int]:
    """(pieces [rank, doc, start, end] int64 [P, 4], span) of documents over dp x cp ranks.

    ``group[doc]``: the dp group whose rows hold the document (dp = max + 1). At span = cp
    the result is the better (lower max rank cost) of the world-wide greedy and the greedy
    run within each group on its own rows. The world-wide one can move documents between
    groups, which wins when documents are small next to a rank's share; with only a few
    documents per group it can do worse than the loader's rows, which split tokens exactly
    evenly.

    ``span``: the ranks one document may be split over, in aligned blocks of consecutive
    global ranks (cp, 2 cp, 4 cp, ... dividing dp x cp, up to ``max_span``; default 4 cp). A
    wider span lets a long document in one dp group's rows spread over the ranks of others
    (a variable CP degree per step, as in Megatron's dynamic CP / ByteScale), but every rank
    of a block then all-gathers the block's keys: a plan widens only when the modelled step
    (the maximum rank cost plus ``cost.gather * span * lmax``) drops by ``widen_gain`` or more.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    group = np.asarray(group, dtype=np.int64)
    dp = int(group.max()) + 1
    ranks = dp * cp
    max_span = min(DEFAULT_SPAN_FACTOR * cp if max_span is None else int(max_span), ranks)

    def max_cost(p: np.ndarray) -> float:
        return float(np.bincount(p[:, 0], weights=cost.cost(p[:, 2], p[:, 3])).max())

    def step_cost(p: np.ndarray, span: int) -> float:
        lmax = np.bincount(p[:, 0], weights=p[:, 3] - p[:, 2]).max()
        return max_cost(p) + cost.gather * span * float(lmax)

    best = _greedy(lengths, dp, cp, cost, max_tokens, tolerance)
    doc_cost = cost.doc_cost(lengths)
    mean = float(doc_cost.sum()) / ranks
    # No plan beats the mean or spreads a document over more than cp ranks; the per-group
    # run is only worth its time when the world-wide one is well off that bound.
    bound = max(mean, float(doc_cost.max()) / cp)
    if dp > 1 and max_cost(best) > (1 + 2 * tolerance) * bound:
        local = []
        for g in range(dp):
            mine = np.flatnonzero(group == g)
            try:
                p = _greedy(lengths[mine], 1, cp, cost, max_tokens, tolerance)
            except PlanError:
                local = []  # this group's own rows do not fit its ranks' budget
                break
            local.append(np.column_stack([p[:, 0] + g * cp, mine[p[:, 1]], p[:, 2:]]))
        if local:
            per_group = np.concatenate(local)
            if max_cost(per_group) < max_cost(best):
                best = per_group
    span, wider = cp, 2 * cp
    best_step = step_cost(best, span)
    # Only a document whose cost over one CP group's ranks is above the mean needs a wider
    # block; otherwise the plan's gap to the mean is packing granularity, which more width
    # rarely closes, at one planning pass per width tried.
    too_long = float(doc_cost.max()) / cp > (1 + 2 * tolerance) * mean
    while (
        too_long
        and max_cost(best) > (1 + 2 * tolerance) * mean
        and wider <= max_span
        and ranks % wider == 0
    ):
        # Blocks of 2 cp may not pair a heavy group with a light one where 4 cp would: try
        # every width, keep a wider one only for a real gain over the best so far.
        try:
            wide = _greedy(lengths, ranks // wider, wider, cost, max_tokens, tolerance)
        except PlanError:  # no room this way (tight budgets): the narrower plan stands
            wider *= 2
            continue
        if step_cost(wide, wider) <= (1 - widen_gain) * best_step:
            best, span, best_step = wide, wider, step_cost(wide, wider)
        wider *= 2
    return best, span
