"""Hierarchical expert all-to-all for an EP group that spans nodes (rail-aligned, two stages).

The EP group's ep = nodes x local ranks are numbered node-major: rank (n, l) = n * local + l.
A flat all-to-all sends every rank's rows straight to every other rank: each rank opens
(nodes - 1) x local small messages across the slow link. Here:

1. inside the node, rank (n, l) sends to its peer (n, l') all its rows for the ranks
   (*, l') of every node (aggregated per destination node, ordered by node);
2. across nodes, rank (n, l) sends to (n', l) only, one message per node pair and rail,
   carrying what the whole node has for (n', l).

Each rank receives the same rows in the same order as from the flat all-to-all (by source
rank, then the source's own order), so results are identical. Both stages are the autograd
all-to-all of expert_parallel (backward: the same exchange reversed), and the reorderings
are index_selects, so gradients follow without a hand-written backward.
"""

from __future__ import annotations

import torch


def permute_segments(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """x holds A x B consecutive row segments, a-major, of sizes[a, b]; return them b-major."""
    a, b = sizes.shape
    flat = sizes.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    order = torch.arange(a * b).view(a, b).t().reshape(-1)
    lengths, base = flat[order], starts[order]
    total = int(lengths.sum())
    out_starts = torch.cumsum(lengths, 0) - lengths
    idx = torch.repeat_interleave(base - out_starts, lengths, output_size=total)
    idx = idx + torch.arange(total)
    return x.index_select(0, idx.to(x.device))


def hierarchical_all_to_all(x: torch.Tensor, send: list[int], recv: list[int],
                            peers_send: torch.Tensor, local_rank: int, intra, inter,
                            all_to_all) -> torch.Tensor:  # fmt: skip
    """Same result as all_to_all(x, recv, send, ep_group).

    send[d] / recv[s]: rows to EP rank d / from EP rank s. peers_send [local, ep]: the send
    vector of every rank of this node (row l = rank (n, l)). intra: the group of this node's
    EP ranks (ordered by l); inter: this rail's group, rank (n, l) for every n (ordered by n).
    all_to_all(x, out_splits, in_splits, group): the differentiable exchange to use."""
    local, ep = peers_send.shape
    nodes = ep // local
    # Stage 1: my rows, ordered by destination (n, l), regrouped by (l, n): block l goes to
    # my node's rank l.
    mine = torch.tensor(send).view(nodes, local)
    staged = permute_segments(x, mine)
    # for_me[l', n]: rows node peer l' has for rank (n, local_rank).
    for_me = peers_send.view(local, nodes, local)[:, :, local_rank]
    gathered = all_to_all(staged, for_me.sum(1).tolist(), mine.sum(0).tolist(), intra)
    # Stage 2: what the node has for rank (n, local_rank), ordered (l', n) -> (n, l'), one
    # block per node of my rail.
    gathered = permute_segments(gathered, for_me)
    from_nodes = torch.tensor(recv).view(nodes, local).sum(1).tolist()
    return all_to_all(gathered, from_nodes, for_me.sum(0).tolist(), inter)
