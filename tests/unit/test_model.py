"""Model invariants: DSA vs dense, shared indices, document masking, MoE dispatch, MTP."""

import dataclasses

import pytest
import torch

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.attention import Attention, make_ropes
from wanka.models.moe import MoE
from wanka.models.stats import count_params, memory_estimate
from wanka.models.transformer import Transformer, mtp_labels

CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, head_dim=16, n_index_heads=2, index_head_dim=8,
                  index_topk=8, n_experts=4, n_active_experts=2, expert_hidden=32, dense_hidden=64,
                  max_seq_len=64)  # fmt: skip


def _inputs(B=2, L=24, docs=((0, 10), (10, 24))):
    doc_ids = torch.zeros(B, L, dtype=torch.int32)
    positions = torch.zeros(B, L, dtype=torch.long)
    for i, (s, e) in enumerate(docs):
        doc_ids[:, s:e] = i
        positions[:, s:e] = torch.arange(e - s)
    return positions, doc_ids


def _model(cfg=CFG, seed=0):
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def _attn_inputs(L=24, B=2, H=4, D=16):
    return torch.randn(B, L, H, D), torch.randn(B, L, D), torch.randn(B, L, D)


def test_sparse_attention_with_all_keys_equals_dense():
    q, k, v = _attn_inputs()
    _, doc_ids = _inputs()
    L = q.shape[1]
    # k >= L: every visible key is selected -> must equal dense causal attention.
    qi, ki, w = torch.randn(2, L, 2, 8), torch.randn(2, L, 8), torch.randn(2, L, 2)
    idx, _ = ops.call("lightning_indexer", qi, ki, w, doc_ids, L + 5)
    assert idx.shape == (2, L, L + 5)
    sparse = ops.call("sparse_attention", q, k, v, idx, 0.25)
    dense = ops.call("dense_attention", q, k, v, doc_ids, 0.25)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_indexer_selects_only_visible_keys():
    L = 24
    _, doc_ids = _inputs(L=L)
    qi, ki, w = torch.randn(2, L, 2, 8), torch.randn(2, L, 8), torch.randn(2, L, 2)
    idx, scores = ops.call("lightning_indexer", qi, ki, w, doc_ids, 6)
    t = torch.arange(L)[None, :, None].expand_as(idx)
    valid = idx >= 0
    assert (idx[valid] <= t[valid]).all(), "future key selected"
    same_doc = doc_ids.gather(1, idx.clamp(min=0).flatten(1)).view_as(idx) == doc_ids[:, :, None]
    assert same_doc[valid].all(), "key from another document selected"
    # the first token of each document sees only itself
    assert valid[:, 0].sum(-1).eq(1).all() and valid[:, 10].sum(-1).eq(1).all()
    assert torch.isinf(scores[~valid]).all() and torch.isfinite(scores[valid]).all()
    # top-k really are the highest-scoring visible keys
    full = ops.call("indexer_scores", qi, ki, w, doc_ids)
    ref = full.topk(6, dim=-1).values
    torch.testing.assert_close(scores, ref)


def test_document_masking_isolates_documents():
    """Changing tokens of document 0 must not change outputs in document 1."""
    torch.manual_seed(1)
    m = _model()
    positions, doc_ids = _inputs()
    tokens = torch.randint(0, 256, (2, 24))
    labels = torch.full_like(tokens, -100)

    def hidden(tok):
        out = {}

        def keep(mod, inputs, output):
            out["h"] = output[0]

        h = m.layers["2"].register_forward_hook(keep)
        m(tok, positions, doc_ids, labels)
        h.remove()
        return out["h"]

    base = hidden(tokens)
    changed = tokens.clone()
    changed[:, :10] = torch.randint(0, 256, (2, 10))
    other = hidden(changed)
    torch.testing.assert_close(base[:, 10:], other[:, 10:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base[:, :10], other[:, :10])


def test_shared_index_layer_equals_layer_recomputing_same_indices():
    torch.manual_seed(2)
    cfg = dataclasses.replace(CFG, index_share_every=2)
    own = Attention(cfg, has_indexer=True)
    reuse = Attention(cfg, has_indexer=False)
    for name in ("wq", "wkv", "wo"):
        getattr(reuse, name).load_state_dict(getattr(own, name).state_dict())
    positions, doc_ids = _inputs()
    x = torch.randn(2, 24, 64)
    ropes = make_ropes(cfg)
    out_own, aux = own(x, positions, doc_ids, ropes, None, "sparse")
    out_reuse, aux_reuse = reuse(x, positions, doc_ids, ropes, aux.indices, "sparse")
    torch.testing.assert_close(out_own, out_reuse)
    assert aux_reuse.kl_sum is None and aux.kl_sum is not None
    assert sum(p.numel() for p in reuse.parameters()) < sum(p.numel() for p in own.parameters())


def test_layers_without_indexer_reuse_the_last_indexer_layers_indices(monkeypatch):
    """In the full model, layer i uses the indices computed by layer i - i % n (and MTP uses
    the last ones), recomputing nothing."""
    m = _model(dataclasses.replace(CFG, n_layers=5, index_share_every=2))
    seen = []
    orig = Attention.forward

    def spy(self, x, positions, doc_ids, ropes, shared_indices, phase, layout=None, draft=None):
        out, aux = orig(self, x, positions, doc_ids, ropes, shared_indices, phase, layout, draft)
        seen.append((self.indexer is not None, shared_indices, aux.indices))
        return out, aux

    monkeypatch.setattr(Attention, "forward", spy)
    positions, doc_ids = _inputs()
    m(torch.randint(0, 256, (2, 24)), positions, doc_ids, torch.full((2, 24), -100))
    assert [own for own, _, _ in seen] == [True, False, True, False, True, False]  # 5 layers + MTP
    for i in (1, 3):
        assert seen[i][1] is seen[i - 1][2], f"layer {i} must reuse layer {i - 1}'s indices"
    assert seen[5][1] is seen[4][2], "the MTP block reuses the last indices"
    assert not torch.equal(seen[0][2], seen[2][2]), "each indexer layer computes its own"


def test_document_result_does_not_depend_on_its_offset_in_the_row():
    """Sparse attention of a document is the same wherever the packer puts it (top-k ties are
    broken by distance, not absolute position)."""
    torch.manual_seed(4)
    cfg = dataclasses.replace(CFG, index_topk=4)
    m = _model(cfg)
    doc = torch.randint(0, 256, (1, 14))

    def run(offset):
        L = offset + 14
        tokens = torch.cat([torch.randint(0, 256, (1, offset)), doc], 1)
        doc_ids = torch.tensor([[0] * offset + [1] * 14])
        positions = torch.cat([torch.arange(offset), torch.arange(14)])[None]
        out = {}

        def keep(mod, inputs, output):
            out["h"] = output[0]

        h = m.layers["2"].register_forward_hook(keep)
        m(tokens, positions, doc_ids, torch.full((1, L), -100))
        h.remove()
        return out["h"][:, offset:]

    torch.testing.assert_close(run(6), run(10), rtol=1e-5, atol=1e-5)


def test_index_share_every_builds_indexers_on_every_nth_layer():
    m = _model(dataclasses.replace(CFG, n_layers=5, index_share_every=2))
    has = [blk.attention.indexer is not None for blk in m.layers.values()]
    assert has == [True, False, True, False, True]


def test_moe_dispatch_combine_preserves_tokens():
    x = torch.randn(10, 6)
    idx = torch.randint(0, 4, (10, 2))
    tokens, counts, order = ops.call("moe_permute", x, idx, 4)
    assert (
        counts.sum() == 20
        and counts.tolist() == torch.bincount(idx.flatten(), minlength=4).tolist()
    )
    # identity experts + weights summing to 1 -> combine returns the input
    w = torch.softmax(torch.randn(10, 2), -1)
    torch.testing.assert_close(ops.call("moe_unpermute", tokens, order, w), x)
    # rows are grouped by expert
    expert_of_row = idx.flatten()[order]
    assert (expert_of_row.diff() >= 0).all()


def test_moe_matches_dense_loop_and_bias_steers_selection():
    torch.manual_seed(3)
    moe = MoE(CFG)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 64)
    y, _ = moe(x)
    idx, w, _ = moe.route(x.view(-1, 64))
    ref = moe.shared(x.view(-1, 64)).clone()
    e = moe.experts
    for n in range(10):
        for j in range(2):
            ex = idx[n, j]
            h = torch.nn.functional.silu(x.view(-1, 64)[n] @ e.w1[ex]) * (
                x.view(-1, 64)[n] @ e.w3[ex]
            )
            ref[n] += w[n, j] * (h @ e.w2[ex])
    torch.testing.assert_close(y.view(-1, 64), ref, rtol=1e-4, atol=1e-5)
    # aux-loss-free balancing: over-loaded experts get lower bias, under-loaded higher.
    load = torch.tensor([10.0, 0.0, 5.0, 5.0])
    moe.update_bias(load, 0.1)
    assert moe.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    moe.expert_bias.copy_(torch.tensor([0.0, 100.0, 0.0, 0.0]))
    idx, _, _ = moe.route(x.view(-1, 64))
    assert (idx == 1).any(-1).all(), "a large bias must force selection of expert 1"


def testmtp_labels_stay_inside_documents():
    labels = torch.tensor([[1, 2, -100, 4, 5, 6]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert mtp_labels(labels, doc_ids, 1).tolist() == [[2, -100, -100, 5, 6, -100]]


def test_dense_warmup_trains_only_the_indexer():
    m = _model()
    positions, doc_ids = _inputs()
    tokens = torch.randint(0, 256, (2, 24))
    labels = torch.roll(tokens, -1, 1)
    parts = m(tokens, positions, doc_ids, labels, phase="dense_warmup")
    parts.kl_sum.backward()
    for name, p in m.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, f"{name} got a gradient in dense warm-up"
    assert parts.kl_sum > 0


def test_sparse_phase_lm_loss_does_not_reach_indexer():
    m = _model()
    positions, doc_ids = _inputs()
    tokens = torch.randint(0, 256, (2, 24))
    parts = m(tokens, positions, doc_ids, torch.roll(tokens, -1, 1), phase="sparse")
    (parts.lm_sum + parts.mtp_sum).backward()
    for name, p in m.named_parameters():
        if ".indexer." in name:
            assert p.grad is None, name
    assert m.layers["1"].moe.experts.w1.grad is not None


def test_flavors_build_on_meta_and_report_sizes():
    from wanka.models.flavors import FLAVORS

    c = count_params(FLAVORS["x25-293b"])
    assert 285e9 < c.total < 300e9 and 25e9 < c.active < 35e9
    small = count_params(FLAVORS["small"])
    assert 80e6 < small.total < 130e6
    # Experts shard over ep, then dp/ep; FSDP2 pads a dim smaller than the shard count, so
    # halving shows from dp 80 to 160 (4 experts per ep rank, 2 then 4 dp/ep shards).
    mem = memory_estimate(FLAVORS["x25-293b"], dp_shard=80, ep=40, seq_len=8192, micro_batch_size=1)
    assert 0 < mem["params_and_optimizer"] < 48 and mem["total"] == pytest.approx(
        sum(v for k, v in mem.items() if k != "total")
    )
    mem2 = memory_estimate(
        FLAVORS["x25-293b"], dp_shard=160, ep=40, seq_len=8192, micro_batch_size=1
    )
    assert mem2["params_and_optimizer"] == pytest.approx(mem["params_and_optimizer"] / 2, rel=0.01)


def test_mtp_self_target_is_the_main_models_own_distribution_ahead():
    """mtp_self: depth 1 at t learns KL(main at t+1 || MTP at t) at positions whose label one
    ahead is valid (same document); the main model's side is a detached target."""
    import torch.nn.functional as F

    m = _model()
    positions, doc_ids = _inputs(docs=((0, 10), (10, 24)))
    tokens = torch.randint(0, 256, (2, 24))
    labels = torch.roll(tokens, -1, 1)
    labels[:, 9] = labels[:, 23] = -100  # each document's last token has no next token
    parts = m(tokens, positions, doc_ids, labels, mtp_self=True)
    # The same quantity by hand: main logits and MTP logits of a plain forward.
    with torch.no_grad():
        h = m.tok_embeddings(tokens)
        ropes = {"attn": m.rope_attn, "index": m.rope_index}
        indices = None
        for blk in m.layers.values():
            h, aux, _ = blk(h, positions, doc_ids, ropes, indices, "sparse", None)
            indices = aux.indices if aux.indices is not None else indices
        main = m._logits(m.norm(h))
        mtp = m.mtp[0]
        ahead = m.tok_embeddings(torch.nn.functional.pad(tokens[:, 1:], (0, 1)))
        g = mtp.proj(torch.cat([mtp.hidden_norm(h), mtp.embed_norm(ahead)], -1))
        g, _, _ = mtp.block(g, positions, doc_ids, ropes, indices, "sparse", None)
        draft = m._logits(mtp.norm(g))
    valid = mtp_labels(labels, doc_ids, 1) != -100
    assert valid.sum() == 2 * (8 + 12)  # not the last two tokens of each document
    want = 0.0
    for b, t in valid.nonzero().tolist():
        p = F.log_softmax(main[b, t + 1], -1)
        q = F.log_softmax(draft[b, t], -1)
        want += float((p.exp() * (p - q)).sum())
    assert int(parts.mtp_count) == int(valid.sum())
    assert float(parts.mtp_sum.detach()) == pytest.approx(want, rel=1e-4)
    parts.mtp_sum.backward()
    # The final norm shapes the main logits only (MTP reads the hidden state before it): the
    # target side is detached, so it gets no gradient.
    assert m.norm.weight.grad is None or m.norm.weight.grad.abs().sum() == 0
    assert m.mtp[0].proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="mtp_self"):
        m(tokens, positions, doc_ids, labels, mtp_self=True, return_logits=True)
