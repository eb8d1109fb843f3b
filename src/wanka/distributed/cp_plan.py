"""Context-parallel (CP) plans: who holds which tokens, and which keys each query piece needs.

The world is dp x cp ranks (global rank = dp_rank * cp + cp_rank). The ranks of one *gather
block* share long sequences: each holds a slice of the queries as a list of document
*pieces*, and the keys/values of the block are all-gathered with every rank's local tokens
padded to ``lmax`` of the block, so token j of the block's r-th rank sits at ``r * lmax + j``
of the gathered buffer. A block is ``span`` consecutive global ranks: the CP group
(span = cp) for contiguous and head_tail; for dynamic the plan may pick 2 cp, 4 cp, ... in a
step whose long documents sit in some dp groups' rows only (``cp_dynamic``).

Input, per step: for each dp group its rows, each row the lengths of its document fragments
(runs of equal ``doc_ids`` of the packed loader). Fragments are the documents here, numbered
0, 1, ... over dp groups, rows and fragments in that order; positions restart at 0 in each,
as the loader's ``positions`` do. Layouts:

- ``contiguous``: each row cut into cp equal chunks, cp-rank r holds chunk r of its group's rows;
- ``head_tail``: each document cut into 2*cp chunks, rank r holds chunks r and 2cp-1-r
  (Megatron's / PyTorch's zigzag, applied per document);
- ``dynamic``: documents of the whole world placed by modelled cost (``cp_dynamic``).

Each rank's local order puts pieces with start == 0 first: their keys are all local
(causal), so they form local runs attended with document masking alone. Runs are packed
up to ``run_cap`` tokens (default: the row length), which keeps each masked run no longer than
today's rows. Every other piece is its own segment whose queries attend a gathered prefix.
Pure numpy: every rank computes the same plan from the same lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_dynamic import PlanError, assign_dynamic

LAYOUTS = ("contiguous", "head_tail", "dynamic")
DEFAULT_SLACK = 0.10  # dynamic: a rank may hold this much more than the mean tokens (memory)

__all__ = [
    "LAYOUTS", "CPPlan", "CostModel", "Piece", "PlanError", "RankLayout", "Segment",
    "plan_step", "rows_from_doc_ids",
]  # fmt: skip


@dataclass(frozen=True)
class Piece:
    doc: int
    start: int  # in-document positions [start, end)
    end: int


@dataclass(frozen=True, eq=False)
class Segment:
    """Queries [q0, q1) of the rank's local sequence and the keys they attend.

    ``key_index is None``: a local run; keys are local tokens [q0, q1) under document
    masking (plus causality). Otherwise: indices into the CP group's gathered buffer of one
    document's prefix [0, piece.end) in document order; the queries are its last q1 - q0
    keys (causal mask aligned bottom-right).
    """

    q0: int
    q1: int
    key_index: np.ndarray | None = None


@dataclass(eq=False)
class RankLayout:
    dp_rank: int
    cp_rank: int
    pieces: list[Piece]  # local order
    segments: list[Segment]  # cover [0, n_tokens) in order
    doc_of_token: np.ndarray  # [n_tokens] int64
    pos_of_token: np.ndarray  # [n_tokens] int64, in-document positions

    @property
    def n_tokens(self) -> int:
        return len(self.doc_of_token)


@dataclass(eq=False)
class CPPlan:
    """One step's plan for all ranks. Piece arrays are in rank-major local order."""

    layout: str
    dp: int
    cp: int
    span: int  # ranks per gather block (a multiple of cp dividing dp * cp)
    doc_table: np.ndarray  # [docs, 3] int64: (source row, start offset in row, length)
    piece_rank: np.ndarray  # [P] global rank
    piece_doc: np.ndarray
    piece_start: np.ndarray
    piece_end: np.ndarray
    piece_q0: np.ndarray  # local offset of each piece on its rank
    lmax: np.ndarray  # [dp * cp / span] longest local length per gather block
    needs_gather: np.ndarray  # [blocks] bool: some rank of the block attends remote keys
    run_cap: int
    _cache: dict[int, RankLayout] = field(default_factory=dict, repr=False)
    _by_doc: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def ranks(self) -> int:
        return self.dp * self.cp

    def tokens_per_rank(self) -> np.ndarray:
        lengths = self.piece_end - self.piece_start
        return np.bincount(self.piece_rank, weights=lengths, minlength=self.ranks).astype(np.int64)

    def block_of(self, dp_rank: int, cp_rank: int) -> int:
        """The gather block of a rank (index into ``lmax`` and ``needs_gather``)."""
        return (dp_rank * self.cp + cp_rank) // self.span

    def rank_costs(self, cost: CostModel) -> np.ndarray:
        w = cost.cost(self.piece_start, self.piece_end)
        return np.bincount(self.piece_rank, weights=w, minlength=self.ranks)

    def imbalance(self, cost: CostModel) -> float:
        c = self.rank_costs(cost)
        return float(c.max() / c.mean()) if c.mean() > 0 else 1.0

    def rank_layout(self, dp_rank: int, cp_rank: int) -> RankLayout:
        rank = dp_rank * self.cp + cp_rank
        if rank not in self._cache:
            self._cache[rank] = _build_layout(self, dp_rank, cp_rank)
        return self._cache[rank]

    def rank_layouts(self) -> list[RankLayout]:
        """All ranks' layouts, by global rank (each rank needs only its own)."""
        return [self.rank_layout(*divmod(r, self.cp)) for r in range(self.ranks)]

    def token_source(self, dp_rank: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(global row, column) in the step's rows of each local token, for filling tokens and
        labels: ``tokens[rows, cols]`` with rows numbered over dp groups then rows."""
        lay = self.rank_layout(dp_rank, cp_rank)
        table = self.doc_table[lay.doc_of_token]
        return table[:, 0], table[:, 1] + lay.pos_of_token


def rows_from_doc_ids(doc_ids: np.ndarray) -> list[list[int]]:
    """Fragment lengths per row of a loader ``doc_ids`` batch [B, L] (runs of equal ids)."""
    out = []
    for row in np.asarray(doc_ids):
        cuts = np.flatnonzero(np.diff(row) != 0) + 1
        out.append(np.diff(np.concatenate([[0], cuts, [len(row)]])).tolist())
    return out


@dataclass
class _Docs:
    lengths: np.ndarray  # [D]
    row: np.ndarray  # [D] global row
    offset: np.ndarray  # [D] start in row
    row_len: np.ndarray  # [rows]
    row_dp: np.ndarray  # [rows]
    dp: int


def _parse(rows: Sequence[Sequence[Sequence[int]]]) -> _Docs:
    if len(rows) == 0 or any(len(group) == 0 for group in rows):
        raise ValueError("plan needs at least one row per dp group")
    flat = [list(map(int, r)) for group in rows for r in group]
    row_dp = np.repeat(np.arange(len(rows)), [len(g) for g in rows])
    counts = np.array([len(r) for r in flat])
    lengths = np.array([n for r in flat for n in r], dtype=np.int64)
    if len(lengths) == 0 or lengths.min() <= 0:
        raise ValueError("document fragment lengths must be positive")
    row = np.repeat(np.arange(len(flat)), counts)
    row_len = np.array([sum(r) for r in flat], dtype=np.int64)
    row_start = np.cumsum(row_len) - row_len  # rows laid end to end
    offset = np.cumsum(lengths) - lengths - row_start[row]
    return _Docs(lengths, row, offset, row_len, row_dp, len(rows))


def _contiguous(docs: _Docs, cp: int) -> np.ndarray:
    bad = docs.row_len % cp != 0
    if bad.any():
        raise ValueError(
            f"contiguous CP layout needs seq_len divisible by cp={cp}, got a row of "
            f"{int(docs.row_len[bad][0])} tokens"
        )
    chunk = docs.row_len[docs.row] // cp
    first = docs.offset // chunk
    last = (docs.offset + docs.lengths - 1) // chunk
    k = last - first + 1  # chunks each document touches
    d = np.repeat(np.arange(len(docs.lengths)), k)
    j = first[d] + np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)
    lo = np.maximum(docs.offset[d], j * chunk[d]) - docs.offset[d]
    hi = np.minimum(docs.offset[d] + docs.lengths[d], (j + 1) * chunk[d]) - docs.offset[d]
    rank = docs.row_dp[docs.row[d]] * cp + j
    return np.stack([rank, d, lo, hi], axis=1)


def _head_tail(docs: _Docs, cp: int) -> np.ndarray:
    # Chunks as equal as possible; a document's L mod 2cp spare tokens go to the chunks after
    # the previous document's, round the 2cp positions, so short documents do not pile their
    # spare tokens onto one rank (1-token documents would otherwise all land on rank 0).
    i = np.arange(2 * cp + 1)
    spare = docs.lengths % (2 * cp)
    first = (np.cumsum(spare) - spare) % (2 * cp)
    extra = (i[None, :-1] - first[:, None]) % (2 * cp) < spare[:, None]
    sizes = docs.lengths[:, None] // (2 * cp) + extra
    bounds = np.concatenate([np.zeros((len(sizes), 1), np.int64), np.cumsum(sizes, 1)], 1)
    cp_rank = np.where(i[:-1] < cp, i[:-1], 2 * cp - 1 - i[:-1])
    rank = docs.row_dp[docs.row][:, None] * cp + cp_rank[None, :]
    d = np.broadcast_to(np.arange(len(docs.lengths))[:, None], rank.shape)
    out = np.stack([rank, d, bounds[:, :-1], bounds[:, 1:]], axis=2).reshape(-1, 4)
    return out[out[:, 3] > out[:, 2]]


def _fill(docs: _Docs, cp: int) -> np.ndarray:
    """Each dp group's documents end to end, cut into cp runs of equal tokens (+-1): no rank
    above ceil(group tokens / cp), whatever the lengths. The last resort of a tight budget."""
    group = docs.row_dp[docs.row]
    out = []
    for g in range(docs.dp):
        mine = np.flatnonzero(group == g)
        n = docs.lengths[mine]
        start = np.cumsum(n) - n  # in the group's stream of documents
        bounds = np.arange(cp + 1) * int(n.sum()) // cp
        for r in range(cp):
            lo, hi = bounds[r], bounds[r + 1]
            for d in np.flatnonzero((start < hi) & (start + n > lo)).tolist():
                s = int(start[d])
                out.append((g * cp + r, mine[d], max(lo, s) - s, min(hi, s + n[d]) - s))
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def _finalize(
    layout: str, docs: _Docs, cp: int, pieces: np.ndarray, run_cap: int, span: int
) -> CPPlan:
    """Merge touching pieces of a document on one rank, order them locally, size the gather."""
    rank, doc, start, end = pieces[pieces[:, 3] > pieces[:, 2]].T
    o = np.lexsort((start, doc, rank))
    rank, doc, start, end = rank[o], doc[o], start[o], end[o]
    new = np.ones(len(rank), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:], [len(rank)]]) - 1
    rank, doc, start, end = rank[first], doc[first], start[first], end[last]
    # Local order: start == 0 pieces (all keys local) first, then the rest, by document.
    o = np.lexsort((start, doc, start > 0, rank))
    rank, doc, start, end = rank[o], doc[o], start[o], end[o]
    ranks = docs.dp * cp
    n = end - start
    rank_first = np.searchsorted(rank, np.arange(ranks))
    q0 = np.cumsum(n) - n
    q0 = q0 - q0[rank_first[rank]]  # restart at each rank
    tokens = np.bincount(rank, weights=n, minlength=ranks).astype(np.int64)
    remote = np.bincount(rank, weights=start > 0, minlength=ranks) > 0
    doc_table = np.stack([docs.row, docs.offset, docs.lengths], axis=1)
    return CPPlan(
        layout, docs.dp, cp, span, doc_table, rank, doc, start, end, q0,
        tokens.reshape(-1, span).max(axis=1), remote.reshape(-1, span).any(axis=1), run_cap,
    )  # fmt: skip


def _build_layout(plan: CPPlan, dp_rank: int, cp_rank: int) -> RankLayout:
    rank = dp_rank * plan.cp + cp_rank
    lo, hi = np.searchsorted(plan.piece_rank, [rank, rank + 1])
    doc, start, end, q0 = (
        a[lo:hi] for a in (plan.piece_doc, plan.piece_start, plan.piece_end, plan.piece_q0)
    )
    n = end - start
    doc_of_token = np.repeat(doc, n)
    pos_of_token = np.arange(n.sum(), dtype=np.int64) - np.repeat(q0 - start, n)
    segments: list[Segment] = []
    run: list[int] | None = None  # the open local run [q0, q1)
    for d, s, e, q in zip(doc.tolist(), start.tolist(), end.tolist(), q0.tolist()):
        q1 = q + e - s
        if s == 0 and run is not None and q1 - run[0] <= plan.run_cap:
            run[1] = q1
            continue
        if run is not None:
            segments.append(Segment(*run))
            run = None
        if s == 0:
            run = [q, q1]
        else:
            segments.append(Segment(q, q1, _key_index(plan, rank // plan.span, d, e)))
    if run is not None:
        segments.append(Segment(*run))
    pieces = [Piece(*p) for p in zip(doc.tolist(), start.tolist(), end.tolist())]
    return RankLayout(dp_rank, cp_rank, pieces, segments, doc_of_token, pos_of_token)


def _key_index(plan: CPPlan, block: int, doc: int, end: int) -> np.ndarray:
    """Gathered-buffer slots of document ``doc``'s positions [0, end) in its gather block."""
    if plan._by_doc is None:  # pieces sorted by (doc, start), built once per plan
        order = np.lexsort((plan.piece_start, plan.piece_doc))
        plan._by_doc = (
            order,
            np.searchsorted(plan.piece_doc[order], np.arange(len(plan.doc_table) + 1)),
        )
    order, ptr = plan._by_doc
    sel = order[ptr[doc] : ptr[doc + 1]]
    sel = sel[plan.piece_start[sel] < end]
    member = plan.piece_rank[sel] - block * plan.span
    if np.any((member < 0) | (member >= plan.span)):
        raise PlanError(f"document {doc} is split across gather blocks")
    base = member * plan.lmax[block] + plan.piece_q0[sel] - plan.piece_start[sel]
    return np.concatenate(
        [b + np.arange(s, min(e, end)) for b, s, e in
         zip(base.tolist(), plan.piece_start[sel].tolist(), plan.piece_end[sel].tolist())]
    ).astype(np.int64)  # fmt: skip


def plan_step(
    rows: Sequence[Sequence[Sequence[int]]],
    cp: int,
    layout: str = "dynamic",
    cost: CostModel | None = None,
    *,
    tolerance: float = 0.01,
    slack: float = DEFAULT_SLACK,
    max_tokens_per_rank: int | None = None,
    run_cap: int | None = None,
    max_span: int | None = None,
) -> CPPlan:
    """Plan one step. ``rows[dp_rank][row]`` = fragment lengths of that row.

    dynamic only: ``tolerance`` on max/mean cost before a document is split; a rank never
    holds more than ``max_tokens_per_rank`` tokens (default ceil(tokens / ranks) * (1 + slack));
    a document is split over at most ``max_span`` ranks (default dp x cp; at least cp).
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    docs = _parse(rows)
    cap = int(run_cap or docs.row_len.max())
    span = cp
    if layout == "contiguous":
        pieces = _contiguous(docs, cp)
    elif layout == "head_tail":
        pieces = _head_tail(docs, cp)
    elif layout == "dynamic":
        ranks = docs.dp * cp
        budget = max_tokens_per_rank or math.ceil(
            math.ceil(int(docs.lengths.sum()) / ranks) * (1 + slack)
        )
        if budget * ranks < docs.lengths.sum():
            raise PlanError(
                f"max_tokens_per_rank={budget} is below the mean of "
                f"{docs.lengths.sum() / ranks:.0f} tokens per rank"
            )
        group = docs.row_dp[docs.row]
        if max_span is not None and max_span < cp:
            raise ValueError(f"max_span={max_span} must be at least cp={cp}")
        try:
            pieces, span = assign_dynamic(
                docs.lengths, group, cp, cost or CostModel(), budget, tolerance, max_span
            )
        except PlanError:
            # The greedy left no rank with room for a document (a tight budget). Head-tail over
            # each group's own rows keeps every rank near the mean: use it if it fits; its
            # chunks round per document, so a budget of exactly the mean needs the even fill.
            for pieces in (_head_tail(docs, cp), _fill(docs, cp)):
                held = np.bincount(pieces[:, 0], weights=pieces[:, 3] - pieces[:, 2],
                                   minlength=ranks)  # fmt: skip
                if held.max() <= budget:
                    break
            else:
                raise

    else:
        raise ValueError(f"unknown CP layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return _finalize(layout, docs, cp, pieces, cap, span)
