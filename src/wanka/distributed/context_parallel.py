"""Context parallelism for DSA: queries stay local, keys are all-gathered over the CP group.

A gather block of ranks (the CP group, or a wider block of whole CP groups that a dynamic
plan picks for one step) shares the documents of one micro-batch; each rank holds a list of
document pieces (cp_plan.py decides which). The attention layers see a `CPLayout`:

- `gather(x)`: this rank's [B, n, ...] keys, values or indexer keys, padded to the block's
  longest local length `Lmax` and all-gathered into [B, span * Lmax, ...]. Its backward is the
  dual collective, a reduce-scatter (sum) of the gradient: one autograd.Function, as in
  nanotron/Megatron.
- `segments`: query ranges [q0, q1) of the local sequence, each either a run of pieces whose
  keys are all local (causal attention: a document's head needs nothing from later ranks) or
  one piece whose keys are its document's prefix, read from the gathered buffer by index.
  The ops take queries as a suffix of the keys (bottom-right aligned causal), so a piece
  [c0, c1) attends with keys [0, c1) of its document and nothing is computed twice.

RoPE positions are in-document positions, which the layout keeps global.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wanka.distributed.cp_dynamic import DEFAULT_SPAN_FACTOR


def pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, n, ...] -> [B, length, ...], zeros after the n tokens (a gather's equal shares)."""
    return F.pad(x, [0, 0] * (x.dim() - 2) + [0, length - x.shape[1]])


class _GatherPadded(torch.autograd.Function):
    """[B, n, ...] -> [B, cp * Lmax, ...]; backward reduce-scatters the gradient (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, Lmax: int) -> torch.Tensor:
        n, cp = x.shape[1], dist.get_world_size(group)
        ctx.group, ctx.n = group, n
        local = pad_tokens(x, Lmax).movedim(1, 0).contiguous()  # [Lmax, B, ...]: gather along dim 0
        out = local.new_empty((cp * Lmax, *local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.movedim(1, 0).contiguous()  # [cp * Lmax, B, ...]
        cp = dist.get_world_size(ctx.group)
        mine = g.new_empty((g.shape[0] // cp, *g.shape[1:]))
        dist.reduce_scatter_single(mine, g, op=dist.ReduceOp.SUM, group=ctx.group)
        return mine[: ctx.n].movedim(0, 1), None, None


@dataclass
class Segment:
    """Queries [q0, q1) of the local sequence and where their keys are."""

    q0: int
    q1: int
    keys: torch.Tensor | None = None  # None: local keys [q0, q1); else gathered-buffer indices
    key_docs: torch.Tensor | None = None  # [1, len(keys)] document ids of those keys (zeros)


@dataclass
class CPLayout:
    """What the attention layers need to run one micro-batch under context parallelism."""

    group: dist.ProcessGroup | None
    Lmax: int
    segments: list[Segment]
    needs_gather: bool
    sparse: bool  # the global sequence is longer than the top-k: sparse attention applies
    mtp_tokens: list[torch.Tensor] = field(default_factory=list)  # depth d: [1, n] input at t+d
    mtp_labels: list[torch.Tensor] = field(default_factory=list)  # depth d: [1, n] label at t+d

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.needs_gather:
            return x
        return _GatherPadded.apply(x, self.group, self.Lmax)

    def to(self, device: torch.device | str) -> CPLayout:
        segs = [
            Segment(
                s.q0, s.q1, *(None if t is None else t.to(device) for t in (s.keys, s.key_docs))
            )
            for s in self.segments
        ]
        return CPLayout(self.group, self.Lmax, segs, self.needs_gather, self.sparse,
                        [t.to(device) for t in self.mtp_tokens],
                        [t.to(device) for t in self.mtp_labels])  # fmt: skip


def shard_rows(
    rows,
    plan,
    dp_rank: int,
    cp_rank: int,
    groups: Mapping[int, dist.ProcessGroup | None],
    mtp_depth: int,
    sparse: bool,
):
    """This rank's pieces of the packed rows `rows` (a data.loader.Batch [G, L] holding every
    row the plan covers) -> (a [1, n] Batch of its tokens, the CPLayout its attention needs).
    `groups[span]`: this rank's gather group of `span` ranks (span = cp: its CP group).

    Labels, positions and the tokens and labels MTP looks ahead to are read from the rows,
    so every token is trained on exactly what it would be without context parallelism."""
    from wanka.data.loader import Batch
    from wanka.models.transformer import mtp_labels

    lay = plan.rank_layout(dp_rank, cp_rank)
    if lay.n_tokens == 0:
        raise RuntimeError(f"context-parallel plan gave rank (dp {dp_rank}, cp {cp_rank}) no "
                           "tokens: the micro-batch has fewer tokens than ranks")  # fmt: skip
    doc = torch.from_numpy(lay.doc_of_token)
    table = torch.from_numpy(plan.doc_table)
    row = table[doc, 0]
    col = table[doc, 1] + torch.from_numpy(lay.pos_of_token)
    L = rows.tokens.shape[1]
    # Fragment ids of the local sequence: one per piece, in local order.
    piece_id = torch.zeros(lay.n_tokens, dtype=torch.int32)
    starts = torch.tensor([0] + [p.end - p.start for p in lay.pieces[:-1]]).cumsum(0)
    piece_id[starts[1:]] = 1
    piece_id = piece_id.cumsum(0, dtype=torch.int32)
    local = Batch(rows.tokens[row, col][None], rows.labels[row, col][None],
                  rows.positions[row, col][None], piece_id[None])  # fmt: skip
    ahead_tokens, ahead_labels = [], []
    for d in range(1, mtp_depth + 1):
        inside = col + d < L
        t = rows.tokens[row, (col + d).clamp(max=L - 1)]
        ahead_tokens.append(torch.where(inside, t, torch.zeros_like(t))[None])
        ahead_labels.append(mtp_labels(rows.labels, rows.doc_ids, d)[row, col][None])
    segs = []
    for s in lay.segments:
        keys = None if s.key_index is None else torch.from_numpy(s.key_index)
        docs = None if keys is None else torch.zeros(1, len(keys), dtype=torch.int32)
        segs.append(Segment(int(s.q0), int(s.q1), keys, docs))
    if plan.span not in groups:
        raise RuntimeError(f"context-parallel plan gathers over {plan.span} ranks but this rank "
                           f"has groups for spans {sorted(groups)} only")  # fmt: skip
    block = plan.block_of(dp_rank, cp_rank)
    layout = CPLayout(groups[plan.span], int(plan.lmax[block]), segs,
                      bool(plan.needs_gather[block]), sparse, ahead_tokens,
                      ahead_labels)  # fmt: skip
    return local, layout


class CPSharder:
    """Per micro-batch: plan who holds which pieces (cp_plan.plan_step, the same on every
    rank) and cut this rank's share out of the rows of the whole dp x cp group.

    `groups`: {span: this rank's gather group of span ranks}, span = cp (the CP group) and,
    for the dynamic layout, the wider blocks it may pick (ParallelDims.gather_groups)."""

    def __init__(self, dp: int, cp: int, dp_rank: int, cp_rank: int,
                 groups: Mapping[int, dist.ProcessGroup | None], layout: str, mtp_depth: int,
                 sparse: bool, cost=None, max_span: int | None = None) -> None:  # fmt: skip
        self.dp, self.cp, self.dp_rank, self.cp_rank = dp, cp, dp_rank, cp_rank
        self.groups, self.layout, self.mtp_depth, self.sparse = groups, layout, mtp_depth, sparse
        self.cost = cost
        self.groups = dict(groups) or {cp: None}  # cp = 1: nothing is ever gathered
        # The plan may only widen to spans this rank has a group for.
        limit = max_span or DEFAULT_SPAN_FACTOR * cp
        self.max_span = max([s for s in self.groups if s <= limit] or [cp])

    def plan(self, rows):
        """The step's plan (cp_plan.CPPlan), the same on every rank of the dp x cp group."""
        from wanka.distributed.cp_plan import plan_step, rows_from_doc_ids

        per_row = rows_from_doc_ids(rows.doc_ids.numpy())
        B = len(per_row) // self.dp
        by_group = [per_row[g * B : (g + 1) * B] for g in range(self.dp)]
        return plan_step(by_group, self.cp, self.layout, self.cost, max_span=self.max_span)

    def __call__(self, rows):
        """rows: a Batch with the micro-batch rows of every dp group, group g's rows at
        [g * B, (g + 1) * B) -> (this rank's [1, n] Batch, its CPLayout)."""
        return shard_rows(rows, self.plan(rows), self.dp_rank, self.cp_rank, self.groups,
                          self.mtp_depth, self.sparse)  # fmt: skip
