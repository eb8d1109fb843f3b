"""Expert parallelism: experts split over the `ep` mesh axis, tokens moved by all-to-all.

The split sizes of the token all-to-all are the only per-layer values read on the host here
(`.tolist()` of the per-rank sums); the per-local-expert counts stay a device tensor.

Each collective is an autograd.Function paired with its backward dual (nanotron-style): the
backward of an all-to-all is the all-to-all with the split sizes swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from wanka import ops


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Send each token copy to the rank owning its expert; bring results back on combine."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def dispatch(self, x, expert_idx, n_experts):
        per_rank = n_experts // self.ep
        tokens, counts, order = ops.call("moe_permute", x, expert_idx, n_experts)
        # counts_recv[r, e]: tokens rank r sends to my local expert e.
        counts_recv = torch.empty_like(counts)
        dist.all_to_all_single(counts_recv, counts, group=self.group)
        send = counts.view(self.ep, per_rank).sum(1).tolist()
        counts_recv = counts_recv.view(self.ep, per_rank)
        recv = counts_recv.sum(1).tolist()
        received = all_to_all(tokens, recv, send, self.group)
        # Received rows are grouped by source rank, then expert: regroup by local expert.
        src_expert = torch.arange(per_rank, device=x.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(
            src_expert, counts_recv.reshape(-1), output_size=sum(recv)
        )
        regroup = torch.argsort(row_expert, stable=True)
        local_counts = counts_recv.sum(0)  # stays on the device for the grouped experts
        return received.index_select(0, regroup), local_counts, (order, send, recv, regroup)

    def combine(self, y, ctx, weights):
        order, send, recv, regroup = ctx
        back = torch.empty_like(y).index_copy(0, regroup, y)
        returned = all_to_all(back, send, recv, self.group)
        return ops.call("moe_unpermute", returned, order, weights)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over `ep` (dim 0) and switch to all-to-all dispatch."""
    for moe in model.moe_layers():
        for name, p in list(moe.experts.named_parameters()):
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)])
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh)
