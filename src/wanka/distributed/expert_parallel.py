"""Expert parallelism: experts split over the `ep` mesh axis, tokens moved by all-to-all.

The split sizes of the token all-to-all are the only per-layer values read on the host here
(`.tolist()` of the per-rank sums); the per-local-expert counts stay a device tensor.

Each collective is an autograd.Function paired with its backward dual (nanotron-style): the
backward of an all-to-all is the all-to-all with the split sizes swapped.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.profiler import record_function

from wanka import ops
from wanka.distributed.hierarchical_a2a import hierarchical_all_to_all

# Profiler labels of the time a rank's main thread is blocked on expert communication.
A2A, A2A_WAIT, A2A_COUNTS = "wanka::ep_a2a", "wanka::ep_a2a_wait", "wanka::ep_a2a_counts"


class BlockedTimer:
    """Seconds the main thread spent blocked in expert communication, when enabled (`wanka
    bench ep`: the exposed-communication fraction without the profiler's own overhead)."""

    enabled = False
    seconds = 0.0


@contextmanager
def _blocked(label: str):
    with record_function(label):
        if not BlockedTimer.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            BlockedTimer.seconds += time.perf_counter() - t0


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with _blocked(A2A):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        with _blocked(A2A):
            dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _Pending:
    """A token all-to-all in flight: its forward work, then its backward's."""

    def __init__(self) -> None:
        self.work = self.grad_work = self.grad = self.keep = None


class _AllToAllStart(torch.autograd.Function):
    """Launch the exchange and return its (not yet filled) output; _AllToAllWait completes
    it. Backward mirrors the pair: the wait's backward launches the reverse exchange, this
    backward collects it, so whatever autograd runs in between (the shared experts'
    backward) overlaps it too."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, pending: _Pending):
        ctx.pending = pending
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        pending.keep = x.contiguous()  # alive until the exchange is done
        pending.work = dist.all_to_all_single(out, pending.keep, out_splits, in_splits,
                                              group=group, async_op=True)  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        with _blocked(A2A_WAIT):
            pending.grad_work.wait()
        g, pending.grad, pending.grad_work, pending.keep = pending.grad, None, None, None
        return g, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, out_splits: list[int], in_splits: list[int], group, pending: _Pending):
        ctx.args = (out_splits, in_splits, group, pending)
        with _blocked(A2A_WAIT):
            pending.work.wait()
        pending.work = pending.keep = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, pending = ctx.args
        pending.grad = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        pending.keep = grad.contiguous()  # alive until the exchange is done, as in forward
        pending.grad_work = dist.all_to_all_single(pending.grad, pending.keep, in_splits,
                                                   out_splits, group=group, async_op=True)  # fmt: skip
        return grad, None, None, None, None


class AllToAllDispatcher:
    """Send each token copy to the rank owning its expert; bring results back on combine.

    hierarchical: (intra group, inter group, ranks per node, local index) when the EP group
    spans nodes: both exchanges go through distributed/hierarchical_a2a.py (same rows, same
    order). overlap: the dispatch exchange runs asynchronously while the shared experts
    compute (flat exchange only)."""

    def __init__(self, ep_mesh: DeviceMesh, hierarchical: tuple | None = None,
                 overlap: bool = False) -> None:  # fmt: skip
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.hier = hierarchical
        self.overlap = overlap and hierarchical is None

    def _exchange(self, x, out_splits, in_splits, peers):
        if self.hier is None:
            return all_to_all(x, out_splits, in_splits, self.group)
        intra, inter, _, local_rank = self.hier
        return hierarchical_all_to_all(x, in_splits, out_splits, peers, local_rank, intra, inter,
                                       all_to_all)  # fmt: skip

    def dispatch(self, x, expert_idx, n_experts):
        per_rank = n_experts // self.ep
        tokens, counts, order = ops.call("moe_permute", x, expert_idx, n_experts)
        # counts_recv[r, e]: tokens rank r sends to my local expert e.
        counts_recv = torch.empty_like(counts)
        with _blocked(A2A_COUNTS):
            dist.all_to_all_single(counts_recv, counts, group=self.group)
        send = counts.view(self.ep, per_rank).sum(1).tolist()
        counts_recv = counts_recv.view(self.ep, per_rank)
        recv = counts_recv.sum(1).tolist()
        peers = None
        if self.hier is not None:  # every node peer's send and receive split sizes
            intra, _, local, _ = self.hier
            mine = torch.tensor([send, recv], dtype=torch.int64)
            both = mine.new_empty((local, 2, self.ep))
            with _blocked(A2A_COUNTS):
                dist.all_gather_into_tensor(both, mine[None], group=intra)
            peers = (both[:, 0], both[:, 1])
        pending = None
        if self.overlap:
            pending = _Pending()
            received = _AllToAllStart.apply(tokens, recv, send, self.group, pending)
        else:
            received = self._exchange(tokens, recv, send, peers and peers[0])
        # Received rows are grouped by source rank, then expert: regroup by local expert.
        src_expert = torch.arange(per_rank, device=x.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(
            src_expert, counts_recv.reshape(-1), output_size=sum(recv)
        )
        regroup = torch.argsort(row_expert, stable=True)
        local_counts = counts_recv.sum(0)  # stays on the device for the grouped experts
        return received, local_counts, (order, send, recv, regroup, peers, pending)

    def arrived(self, received, ctx):
        _, send, recv, regroup, _, pending = ctx
        if pending is not None:
            received = _AllToAllWait.apply(received, recv, send, self.group, pending)
        return received.index_select(0, regroup)

    def combine(self, y, ctx, weights):
        order, send, recv, regroup, peers, _ = ctx
        back = torch.empty_like(y).index_copy(0, regroup, y)
        returned = self._exchange(back, send, recv, peers and peers[1])
        return ops.call("moe_unpermute", returned, order, weights)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, hierarchical: tuple | None = None,
                          overlap: bool = False) -> None:  # fmt: skip
    """Shard every MoE layer's experts over `ep` (dim 0) and switch to all-to-all dispatch."""
    for moe in model.moe_layers():
        for name, p in list(moe.experts.named_parameters()):
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)])
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh, hierarchical, overlap)
