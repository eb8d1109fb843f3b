"""Speculative sampling keeps the target distribution (chi-square tests that a biased rule
fails: the negative controls below show they can)."""

from __future__ import annotations

import dataclasses
import math

import torch

from wanka.config.schema import ModelConfig
from wanka.infer import generate as generate_mod
from wanka.infer.cache import KVCache
from wanka.infer.generate import Generator
from wanka.infer.sampling import Sampling, accept_drafts, probabilities
from wanka.models.transformer import Transformer

Z_999 = 3.09  # one-sided normal quantile for p = 0.001


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at p = 0.001: cells expecting fewer than 5 are pooled into one."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat < crit


def _synthetic(V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p2[x1] = P(x2 | x1)
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    return p1, p2, q1, q2


def test_accept_drafts_output_follows_the_target():
    """Drafts from q (wrong on purpose), target p: the first token follows p1, and the
    second, where the first draft was kept, follows p2 given the first."""
    V, B = 6, 60_000
    p1, p2, q1, q2 = _synthetic(V, 0)
    g = torch.Generator().manual_seed(1)
    d = torch.stack([torch.multinomial(q1, B, True, generator=g),
                     torch.multinomial(q2, B, True, generator=g)], 1)  # fmt: skip
    target = torch.stack([p1.expand(B, V), p2[d[:, 0]], torch.full((B, V), 1.0 / V)], 1)
    draft = torch.stack([q1.expand(B, V), q2.expand(B, V)], 1)
    accepted, nxt = accept_drafts(target, draft, d, g)
    x1 = torch.where(accepted >= 1, d[:, 0], nxt)
    assert _chi2_ok(torch.bincount(x1, minlength=V), p1)
    kept = accepted >= 1
    x2 = torch.where(accepted[kept] >= 2, d[kept, 1], nxt[kept])
    for a in range(V):
        rows = x1[kept] == a
        assert _chi2_ok(torch.bincount(x2[rows], minlength=V), p2[a]), a
    # Negative control: keeping every draft gives q1, which the test must reject.
    assert not _chi2_ok(torch.bincount(d[:, 0], minlength=V), p1)


def _tiny(V: int = 8) -> Transformer:
    cfg = ModelConfig(vocab_size=V, n_layers=2, index_topk=8, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(4)  # at this init: ~20 of the 64 (x1, x2) pairs have P > 1%
    return model.eval()


def _next_probs(model: Transformer, seqs: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    B, L = seqs.shape
    cache = KVCache(len(model.layers), B, seqs.device)
    docs = cache.set_docs(0, torch.zeros(B, L, dtype=torch.long))
    with torch.no_grad():
        logits = model.decode(seqs, torch.arange(L).expand(B, L), cache, 0, docs)[0]
    return probabilities(logits[:, -1], sampling)


def _exact_pairs(model, prompt, sampling, V):
    """Exact P(x1, x2) and P(x2, x3) of the first three sampled tokens."""
    base = torch.tensor(prompt)
    p1 = _next_probs(model, base[None], sampling)[0]
    s2 = torch.cat([base.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2 = _next_probs(model, s2, sampling)  # [x1, x2]
    s3 = torch.cat([s2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3 = _next_probs(model, s3, sampling).view(V, V, V)  # [x1, x2, x3]
    p12 = p1[:, None] * p2
    p23 = (p12[..., None] * p3).sum(0)
    return p12.reshape(-1), p23.reshape(-1)


def _sample_pairs(model, prompt, sampling, V, speculate, n):
    out = Generator(model, sampling, speculate=speculate, seed=7).generate([prompt] * n, 3)
    t = torch.tensor(out)
    c12 = torch.bincount(t[:, 0] * V + t[:, 1], minlength=V * V)
    c23 = torch.bincount(t[:, 1] * V + t[:, 2], minlength=V * V)
    return c12, c23


def test_sampled_generation_with_speculation_keeps_the_model_distribution(monkeypatch):
    V, prompt = 8, [1, 5, 2, 7]
    model = _tiny(V)
    for sampling in (Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.8)):
        p12, p23 = _exact_pairs(model, prompt, sampling, V)
        c12, c23 = _sample_pairs(model, prompt, sampling, V, speculate=2, n=1500)
        assert _chi2_ok(c12, p12), sampling
        assert _chi2_ok(c23, p23), sampling

    # Negative control: a verifier that keeps every draft follows the MTP head, not the model.
    def keep_all(target, draft, drafts, gen):
        B, N = drafts.shape
        return torch.full((B,), N), torch.multinomial(target[:, N], 1, generator=gen)[:, 0]

    monkeypatch.setattr(generate_mod, "accept_drafts", keep_all)
    sampling = Sampling(temperature=1.0)
    p12, p23 = _exact_pairs(model, prompt, sampling, V)
    c12, c23 = _sample_pairs(model, prompt, sampling, V, speculate=2, n=1500)
    assert not (_chi2_ok(c12, p12) and _chi2_ok(c23, p23))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.85))  # needs the third
    assert (p > 0).sum() == 3
    assert dataclasses.replace(Sampling(), temperature=0.0).greedy
