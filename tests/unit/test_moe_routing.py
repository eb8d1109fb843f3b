"""MoE fidelity: group-limited routing, the sequence-wise balance loss, the grouped experts in
the layer (vs the loop, no host copy of the counts in local dispatch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wanka.config.schema import ModelConfig
from wanka.models.flavors import FLAVORS
from wanka.models.moe import LocalDispatcher, MoE
from wanka.models.transformer import Transformer
from wanka.ops import registry

CFG = ModelConfig(dim=32, n_layers=3, n_heads=2, head_dim=16, n_index_heads=2, index_head_dim=8,
                  index_topk=8, n_experts=16, n_active_experts=4, expert_hidden=16,
                  dense_hidden=32, max_seq_len=64)  # fmt: skip


def _moe(cfg=CFG, seed=0, bias_std=0.0):
    torch.manual_seed(seed)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.expert_bias.normal_(std=bias_std)
    return moe


def _groups_used(idx: torch.Tensor, group_size: int) -> torch.Tensor:
    g = idx // group_size
    return torch.tensor([len(set(row.tolist())) for row in g])


@pytest.mark.parametrize("groups, limited", [(4, 2), (4, 1), (8, 3), (16, 4)])
def test_group_limited_routing_stays_inside_the_allowed_groups(groups, limited):
    cfg = dataclasses.replace(CFG, n_expert_groups=groups, n_limited_groups=limited)
    moe = _moe(cfg, bias_std=0.05)
    x = torch.randn(512, cfg.dim)
    idx, w, scores = moe.route(x)
    size = cfg.n_experts // groups
    assert (_groups_used(idx, size) <= limited).all()
    free, _, _ = _moe(CFG, bias_std=0.05).route(x)  # same weights, no group limit
    if size > 1:  # the limit bites: unrestricted routing spans more groups for some tokens
        assert (_groups_used(free, size) > limited).any()
    else:  # one-expert groups: the best k groups by top-1 are the plain top-k experts
        assert torch.equal(idx.sort(-1).values, free.sort(-1).values)
    # the kept groups are the best by (top-2, or top-1 for 1-expert groups) biased affinity
    biased = (scores + moe.expert_bias).view(-1, groups, size)
    gscore = biased.topk(min(2, size), -1).values.sum(-1)
    best = gscore.topk(limited, -1).indices.sort(-1).values
    for row, b in zip(idx // size, best):
        assert set(row.tolist()) <= set(b.tolist())
    # within the kept groups, the top-k of the biased affinities; weights as before
    masked = torch.full_like(biased, float("-inf"))
    keep = best[..., None].expand(-1, -1, size)
    masked.scatter_(1, keep, biased.gather(1, keep))
    assert (
        idx.sort(-1).values == masked.view(len(x), -1).topk(4, -1).indices.sort(-1).values
    ).all()
    s = scores.gather(-1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("groups", [1, 4])
def test_no_group_limit_routes_exactly_as_plain_top_k(groups):
    """1 of 1 groups (the default), or every group allowed: today's top-k, bit for bit."""
    cfg = dataclasses.replace(CFG, n_expert_groups=groups, n_limited_groups=groups)
    moe = _moe(cfg, bias_std=0.05)
    x = torch.randn(256, cfg.dim)
    idx, w, scores = moe.route(x)
    ref_scores = torch.sigmoid(moe.router(x).float())
    _, ref_idx = (ref_scores + moe.expert_bias).topk(cfg.n_active_experts, dim=-1)
    ref_w = ref_scores.gather(-1, ref_idx)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(w, ref_w / ref_w.sum(-1, keepdim=True) * cfg.route_scale)


def test_balance_losses_on_a_hand_computed_case():
    moe = _moe(dataclasses.replace(CFG, n_experts=4, n_active_experts=2))
    # 2 sequences x 2 tokens, top-2 of 4 experts. Normalised affinities s_i / sum_j s_j:
    scores = torch.tensor([[1.0, 1, 1, 1], [3, 1, 0, 0],  # seq 0: p = [.25]*4, [.75, .25, 0, 0]
                           [0, 0, 1, 1], [1, 0, 0, 3]])  # seq 1: p = [0, 0, .5, .5], [.25, 0, 0, .75]  # fmt: skip
    idx = torch.tensor([[0, 1], [0, 1], [2, 3], [0, 3]])
    counts = torch.bincount(idx.flatten(), minlength=4)
    out = moe.balance_losses(idx, scores, counts, n_seq=2)
    # seq 0: f = 4/(2*2) * counts [2, 2, 0, 0] = [2, 2, 0, 0]; P = [.5, .25, .125, .125] -> 1.5
    # seq 1: f = [1, 0, 1, 2]; P = [.125, 0, .25, .625] -> .125 + .25 + 1.25 = 1.625
    assert out.seq_balance.item() == pytest.approx((1.5 + 1.625) / 2)
    # batch: f = 4/(2*4) * [3, 2, 1, 2] = [1.5, 1, .5, 1]; P = [.3125, .125, .1875, .375]
    assert out.balance.item() == pytest.approx(1.5 * 0.3125 + 0.125 + 0.5 * 0.1875 + 0.375)
    # perfectly balanced, uniform affinities: both are 1
    flat = moe.balance_losses(idx[:2], torch.ones(2, 4), torch.tensor([2, 2, 0, 0]), n_seq=1)
    assert flat.seq_balance.item() == pytest.approx(1.0)


def test_seq_balance_has_gradient_wrt_the_router_only():
    moe = _moe()
    _, losses = moe(torch.randn(3, 10, CFG.dim))
    assert losses.seq_balance.item() > 0
    losses.seq_balance.backward()
    for name, p in moe.named_parameters():
        if name.startswith("router."):
            assert p.grad is not None and p.grad.abs().sum() > 0
        else:
            assert p.grad is None, name


def test_model_reports_seq_balance_as_the_mean_over_moe_layers():
    cfg = dataclasses.replace(CFG, n_expert_groups=4, n_limited_groups=2)
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(0)
    seen = []
    for moe in m.moe_layers():
        moe.register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    tokens = torch.randint(0, 256, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    doc = torch.zeros(2, 16, dtype=torch.int32)
    parts = m(tokens, pos, doc, torch.roll(tokens, -1, 1))
    n_moe = cfg.n_layers - cfg.n_dense_layers
    assert len(seen) == n_moe
    torch.testing.assert_close(parts.seq_balance, torch.stack([s.seq_balance for s in seen]).mean())
    torch.testing.assert_close(parts.balance, torch.stack([s.balance for s in seen]).mean())
    parts.seq_balance.backward()
    # in the last MoE layer only the router learns from it (earlier layers do, through the
    # routers' inputs), nor does anything after it
    last = f"layers.{cfg.n_layers - 1}.moe."
    for name, p in m.named_parameters():
        if name.startswith(last):
            assert (p.grad is not None) == name.startswith(last + "router."), name
    assert m.tok_embeddings.weight.grad is not None and m.norm.weight.grad is None


@pytest.mark.parametrize("backend", ["padded_bmm", "grouped_mm"])
def test_moe_layer_with_grouped_experts_matches_the_loop(backend, monkeypatch):
    moe = _moe()
    x = torch.randn(2, 24, CFG.dim)
    outs = {}
    for b in ("reference", backend):
        monkeypatch.setenv(registry.ENV_OVERRIDE, f"grouped_swiglu={b}")
        moe.zero_grad()
        y, losses = moe(x)
        (y.square().sum() + losses.balance).backward()
        outs[b] = [y.detach(), *(p.grad.clone() for p in moe.parameters())]
    for a, b in zip(outs[backend], outs["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _no_host_reads(monkeypatch) -> list[str]:
    reads = []
    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name):
            reads.append(_name)
            return _real(self, *a)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def test_local_moe_layer_reads_nothing_on_the_host_with_grouped_mm(monkeypatch):
    """Local dispatch keeps the counts on the device; `_grouped_mm` takes them as offsets, so
    the whole layer (forward and backward) needs no host read; the padded bmm reads one
    scalar (the largest count) per call, the loop the whole count list."""
    moe = _moe()
    x = torch.randn(2, 24, CFG.dim)
    _, counts, _ = LocalDispatcher().dispatch(x.view(-1, CFG.dim), torch.randint(0, 3, (48, 2)), 3)
    assert isinstance(counts, torch.Tensor)
    expected = {"grouped_mm": [], "padded_bmm": ["__int__"], "reference": ["tolist"]}
    for backend, want in expected.items():
        monkeypatch.setenv(registry.ENV_OVERRIDE, f"grouped_swiglu={backend}")
        with monkeypatch.context() as mp:
            reads = _no_host_reads(mp)
            y, losses = moe(x)
            (y.sum() + losses.balance + losses.seq_balance).backward()
        assert reads == want, backend


def test_production_flavor_uses_node_limited_routing_and_seq_balance():
    f = FLAVORS["x25-293b"]
    assert (f.n_expert_groups, f.n_limited_groups, f.seq_balance_loss_weight) == (8, 4, 1e-4)
    assert f.n_experts % f.n_expert_groups == 0
    assert f.n_active_experts <= f.n_limited_groups * f.n_experts // f.n_expert_groups


@pytest.mark.slow  # inductor compiles for ~40 s; test_compile covers capture in CI
def test_moe_layer_compiles_with_the_default_backend(monkeypatch):
    """torch.compile of the layer (as distributed/compile.py does): the fp32 CPU `_grouped_mm`
    runs eagerly inside it (its fake-tensor rule is bf16-only), results unchanged."""
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    moe = _moe(dataclasses.replace(CFG, n_expert_groups=4, n_limited_groups=2))
    x = torch.randn(2, 8, CFG.dim)
    grads = []
    for fwd in (moe.forward, torch.compile(moe.forward)):
        moe.zero_grad()
        y, losses = fwd(x)
        (y.square().sum() + losses.seq_balance).backward()
        grads.append([y.detach(), *(p.grad for p in moe.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
