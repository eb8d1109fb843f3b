"""Hierarchical and overlapped expert all-to-all vs the flat one, on gloo ranks emulating
nodes (3 x 2 for the exchange, 2 x 2 for a model step): the same rows in the same order, so
the same bits, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.helpers import spawn
from tests.distributed.parallel_step import build, step
from wanka.distributed.expert_parallel import all_to_all
from wanka.distributed.hierarchical_a2a import hierarchical_all_to_all, permute_segments
from wanka.distributed.parallel_dims import ParallelDims


def test_permute_segments():
    x = torch.arange(10)[:, None]
    sizes = torch.tensor([[1, 2], [3, 4]])  # a-major: [0], [1 2], [3 4 5], [6 7 8 9]
    assert permute_segments(x, sizes).view(-1).tolist() == [0, 3, 4, 5, 1, 2, 6, 7, 8, 9]
    empty = torch.tensor([[0, 2], [0, 0]])
    assert permute_segments(torch.arange(2)[:, None], empty).view(-1).tolist() == [0, 1]


def _exchange(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        rank, ep = dist.get_rank(), dist.get_world_size()
        dims = ParallelDims.resolve(-1, ep, ep)
        dims.ranks_per_node = 2
        dims.build_meshes("cpu")
        intra, inter, local, local_rank = dims.ep_hierarchy()
        g = torch.Generator().manual_seed(rank)
        send = torch.randint(0, 5, (ep,), generator=g)
        send[rank % ep] = 0  # some empty segments
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_l, recv_l = send.tolist(), recv.tolist()
        peers = send.new_empty((local, ep))
        dist.all_gather_into_tensor(peers, send[None].contiguous(), group=intra)
        x = torch.randn(sum(send_l), 3, generator=g, dtype=torch.float64)
        # Tag every row with (source rank, row index) so order is checked, not just values.
        x[:, 0] = rank * 1000 + torch.arange(len(x), dtype=torch.float64)
        weight = torch.randn(sum(recv_l), 3, dtype=torch.float64, generator=g)
        res = {}
        for name in ("flat", "hier"):
            xi = x.clone().requires_grad_(True)
            if name == "flat":
                y = all_to_all(xi, recv_l, send_l, dims.mesh("ep").get_group())
            else:
                y = hierarchical_all_to_all(xi, send_l, recv_l, peers, local_rank, intra, inter,
                                            all_to_all)  # fmt: skip
            (y * weight).sum().backward()
            res[name] = (y.detach(), xi.grad)
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_hierarchical_all_to_all_is_the_flat_one(tmp_path):
    spawn(6, _exchange, str(tmp_path))  # 3 nodes x 2: nodes != ranks per node
    for r in range(6):
        res = torch.load(tmp_path / f"rank{r}.pt")
        (yf, gf), (yh, gh) = res["flat"], res["hier"]
        assert yf.shape[0] > 0 and torch.equal(yf, yh), f"rank {r}: forward differs"
        assert torch.equal(gf, gh), f"rank {r}: backward differs"


def _model_steps(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        dims = ParallelDims.resolve(-1, 4, 4)
        dims.ranks_per_node = 2
        dims.build_meshes("cpu")
        variants = {"flat": {}, "hierarchical": {"expert_a2a": "hierarchical"},
                    "overlap": {"ep_overlap": True}}  # fmt: skip
        res = {name: step(build(dims, **opts), dims) for name, opts in variants.items()}
        # The overlapped dispatch returns with its exchange still in flight (a Work handle).
        moe = build(dims, ep_overlap=True).moe_layers()[0]
        x = torch.randn(8, moe.router.weight.shape[1])
        _, _, ctx = moe.dispatcher.dispatch(x, torch.randint(0, 8, (8, 2)), 8)
        pending = ctx[-1]
        res["in_flight"] = isinstance(pending.work, dist.Work)
        pending.work.wait()
        if dist.get_rank() == 0:
            torch.save(res, Path(out) / "res.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_a2a_model")
    spawn(4, _model_steps, str(out))
    return torch.load(out / "res.pt", weights_only=False)


def test_overlapped_dispatch_is_asynchronous(model_results):
    assert model_results["in_flight"]


@pytest.mark.parametrize("variant", ["hierarchical", "overlap"])
def test_model_step_is_bitwise_the_flat_one(model_results, variant):
    res = model_results
    flat, got = res["flat"], res[variant]
    assert torch.equal(flat["sums"], got["sums"])
    assert torch.equal(flat["loads"], got["loads"])
    for name, g in flat["grads"].items():
        assert torch.equal(got["grads"][name], g), name
