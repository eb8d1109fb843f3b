"""Post-training losses: KLs against brute force, masking, the sampled estimator's unbiasedness,
TRL's JSD convention, GRPO advantages and the clipped objective."""

from __future__ import annotations

import math

import pytest
import torch

from wanka.post.losses import (
    forward_kl,
    generalized_jsd,
    group_advantages,
    grpo_loss,
    reverse_kl_exact,
    reverse_kl_sampled,
    token_logprobs,
)

B, T, V = 2, 3, 5


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g) * scale


def _mask() -> torch.Tensor:
    return torch.tensor([[True, True, False], [False, True, True]])


def _softmax(row: list[float]) -> list[float]:
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))


def _brute(fn, s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Per-token values by a plain double loop over (b, t) in Python floats."""
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for i in range(T):
            if mask[b, i]:
                out[b][i] = fn(_softmax(s[b, i].tolist()), _softmax(t[b, i].tolist()))
    return out


def _jsd_brute(beta: float):
    def f(ps: list[float], pt: list[float]) -> float:
        m = [beta * a + (1 - beta) * b for a, b in zip(pt, ps)]
        return beta * _kl(pt, m) + (1 - beta) * _kl(ps, m)

    return f


EXACT = {
    "reverse": (lambda s, t, m: reverse_kl_exact(s, t, m), lambda ps, pt: _kl(ps, pt)),
    "forward": (lambda s, t, m: forward_kl(s, t, m), lambda ps, pt: _kl(pt, ps)),
    "jsd0.3": (lambda s, t, m: generalized_jsd(s, t, m, 0.3), _jsd_brute(0.3)),
    "jsd0.8": (lambda s, t, m: generalized_jsd(s, t, m, 0.8), _jsd_brute(0.8)),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_divergences_match_brute_force_and_are_nonnegative(name: str) -> None:
    fn, brute = EXACT[name]
    s, t, mask = _logits(0), _logits(1), _mask()
    loss, per = fn(s, t, mask)
    expected = torch.tensor(_brute(brute, s, t, mask))
    torch.testing.assert_close(per, expected, atol=1e-5, rtol=1e-5)
    assert loss.item() == pytest.approx(expected.sum().item(), rel=1e-5)
    assert loss.dim() == 0 and per.shape == (B, T) and not per.requires_grad
    assert (per[mask] > 0).all()  # distinct distributions: strictly positive
    assert (per[~mask] == 0).all()
    for seed in range(20):  # non-negative on many random pairs, including sharp ones
        _, p = fn(_logits(10 + seed, 6.0), _logits(50 + seed, 6.0), torch.ones(B, T, dtype=bool))
        assert (p >= -1e-6).all()


@pytest.mark.parametrize("name", sorted(EXACT) + ["sampled"])
def test_identical_logits_give_zero_loss_and_zero_gradient(name: str) -> None:
    s = _logits(2).requires_grad_()
    t = s.detach().clone()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    if name == "sampled":
        loss, per = reverse_kl_sampled(s, t, targets, _mask())
    else:
        loss, per = EXACT[name][0](s, t, _mask())
    loss.backward()
    assert abs(loss.item()) < 1e-6 and per.abs().max().item() < 1e-6
    assert s.grad.abs().max().item() < 1e-6


def _all_losses(s, t, targets, mask):
    return {
        "reverse": reverse_kl_exact(s, t, mask),
        "forward": forward_kl(s, t, mask),
        "jsd": generalized_jsd(s, t, mask, 0.5),
        "sampled": reverse_kl_sampled(s, t, targets, mask),
    }


def test_masked_positions_contribute_nothing() -> None:
    mask = _mask()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    results = []
    for variant in range(3):
        s, t = _logits(3), _logits(4)
        if variant:  # change (or poison) only the masked-out positions
            s[~mask] = float("nan") if variant == 2 else 100.0
            t[~mask] = float("inf") if variant == 2 else -100.0
        s.requires_grad_()
        out = _all_losses(s, t, targets, mask)
        grads = {k: torch.autograd.grad(v[0], s)[0] for k, v in out.items()}
        results.append(({k: v[0].item() for k, v in out.items()}, grads))
    base_vals, base_grads = results[0]
    for vals, grads in results[1:]:
        assert vals == pytest.approx(base_vals, rel=1e-6)
        for k in grads:
            torch.testing.assert_close(grads[k], base_grads[k])
            assert (grads[k][~mask] == 0).all()
    assert all(g[mask].abs().sum() > 0 for g in base_grads.values())  # the control moves


def test_teacher_receives_no_gradient() -> None:
    s, t = _logits(5).requires_grad_(), _logits(6).requires_grad_()
    targets = torch.zeros(B, T, dtype=torch.long)
    total = sum(v[0] for v in _all_losses(s, t, targets, _mask()).values())
    total.backward()
    assert t.grad is None
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_bf16_logits_are_upcast() -> None:
    s, t = _logits(7), _logits(8)
    loss32, _ = reverse_kl_exact(s, t, _mask())
    loss16, per16 = reverse_kl_exact(s.bfloat16(), t.bfloat16(), _mask())
    assert loss16.dtype == torch.float32 and per16.dtype == torch.float32
    # Same inputs (after rounding to bf16) computed in fp32: close to the fp32 result.
    ref, _ = reverse_kl_exact(s.bfloat16().float(), t.bfloat16().float(), _mask())
    assert loss16.item() == pytest.approx(ref.item(), rel=1e-6)
    assert loss16.item() == pytest.approx(loss32.item(), rel=5e-2)


def test_token_logprobs() -> None:
    s = _logits(9)
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    lp = token_logprobs(s.bfloat16(), targets)
    assert lp.dtype == torch.float32 and lp.shape == (B, T)
    expected = torch.log_softmax(s.bfloat16().float(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(lp, expected)


def _per_sample_grads(s_row, t_row, xs):
    """Gradient of the sampled surrogate w.r.t. the logits, one row per sample x."""
    n = xs.numel()
    s = s_row.expand(n, 1, V).clone().requires_grad_()
    t = t_row.expand(n, 1, V)
    loss, per = reverse_kl_sampled(s, t, xs.view(n, 1), torch.ones(n, 1, dtype=bool))
    loss.backward()
    return s.grad[:, 0], per[:, 0], loss


def test_sampled_estimator_is_unbiased_for_the_exact_reverse_kl_gradient() -> None:
    g = torch.Generator().manual_seed(3)
    s_row = torch.tensor([1.5, 0.2, -0.7, 0.9, -1.2])
    t_row = torch.tensor([-0.5, 1.1, 0.3, -1.0, 0.8])
    s_exact = s_row.view(1, 1, V).clone().requires_grad_()
    kl, _ = reverse_kl_exact(s_exact, t_row.view(1, 1, V), torch.ones(1, 1, dtype=bool))
    kl.backward()
    exact = s_exact.grad.view(V)

    n = 200_000

    def check(sampling_logits):
        xs = torch.multinomial(torch.softmax(sampling_logits, -1), n, replacement=True, generator=g)
        grads, k, loss = _per_sample_grads(s_row, t_row, xs)
        mean, se = grads.mean(0), grads.std(0) / math.sqrt(n)
        return (mean - exact).abs() / se, k, loss

    z, k, loss = check(s_row)  # x ~ p_s: on-policy
    assert z.max().item() < 5.0, f"on-policy gradient off by {z.max():.1f} standard errors"
    # The value is the k1 estimate: unbiased for the KL itself, and what loss_sum reads.
    assert loss.item() == pytest.approx(k.sum().item(), rel=1e-5)
    assert k.mean().item() == pytest.approx(kl.item(), abs=5 * k.std().item() / math.sqrt(n))

    z_off, _, _ = check(t_row)  # negative control: x from the teacher, not the student
    assert z_off.max().item() > 20.0, "off-policy samples should give a biased gradient"


def test_jsd_end_points_are_the_two_kls_in_trls_convention() -> None:
    s, t, mask = _logits(11, 3.0).double(), _logits(12, 0.5).double(), _mask()
    fwd, rev = forward_kl(s, t, mask)[0].item(), reverse_kl_exact(s, t, mask)[0].item()
    assert abs(fwd - rev) > 0.1 * fwd  # asymmetric enough to tell the directions apart
    # TRL: beta=0 -> forward KL(p_t || p_s), beta=1 -> reverse KL(p_s || p_t), unscaled.
    assert generalized_jsd(s, t, mask, 0.0)[0].item() == pytest.approx(fwd, rel=1e-6)
    assert generalized_jsd(s, t, mask, 1.0)[0].item() == pytest.approx(rev, rel=1e-6)
    # The interior approaches the same KLs once divided by beta (resp. 1 - beta): the
    # direction is that of the paper's limits, not just of the special cases.
    eps = 1e-6
    assert generalized_jsd(s, t, mask, eps)[0].item() / eps == pytest.approx(fwd, rel=1e-2)
    assert generalized_jsd(s, t, mask, 1 - eps)[0].item() / eps == pytest.approx(rev, rel=1e-2)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, mask, 1.5)


def test_group_advantages_known_numbers() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0])
    adv = group_advantages(r, 4, eps=0.0)
    std3 = math.sqrt((3 * 0.75**2 + 2.25**2) / 4)  # population std of (0, 0, 0, 3)
    expected = [1, -1, -1, 1, 0, 0, 0, 0] + [-0.75 / std3] * 3 + [2.25 / std3]
    torch.testing.assert_close(adv, torch.tensor(expected))
    # Population std: a group of two {0, 1} gets +-1 (the sample std would give +-0.71).
    torch.testing.assert_close(
        group_advantages(torch.tensor([0.0, 1.0]), 2), torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0
    )
    # Equal rewards whose float mean is inexact still give exact zeros.
    same = torch.full((7,), 0.1)
    assert (same - same.mean()).abs().max() > 0  # the rounding the guard exists for
    assert (group_advantages(same, 7) == 0).all()
    assert (group_advantages(torch.tensor([0.3, 0.7, 0.1]), 1) == 0).all()
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.ones(6), 4)


def _grpo_inputs():
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(3, 4, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.5, 2.0])
    return logp, mask, adv


def test_grpo_at_ratio_one_is_minus_advantage_per_token() -> None:
    logp, mask, adv = _grpo_inputs()
    new = logp.clone().requires_grad_()
    loss, stats = grpo_loss(new, logp, logp, adv, mask, clip_eps=0.2, kl_coef=0.1)
    counts = mask.sum(1).float()
    assert loss.item() == pytest.approx(-(adv * counts).sum().item(), rel=1e-6)
    assert stats == pytest.approx({"clip_fraction": 0.0, "kl_mean": 0.0, "ratio_mean": 1.0})
    loss.backward()
    torch.testing.assert_close(new.grad, -adv[:, None].expand(3, 4) * mask)


def test_grpo_kl_term_is_k3() -> None:
    logp, mask, adv = _grpo_inputs()
    ref = logp + torch.linspace(-1, 1, 12).view(3, 4)
    base, _ = grpo_loss(logp, logp, logp, adv, mask, 0.2, kl_coef=0.0)
    loss, stats = grpo_loss(logp, logp, ref, adv, mask, 0.2, kl_coef=0.5)
    d = (ref - logp)[mask]
    k3 = torch.exp(d) - d - 1
    assert (k3 >= 0).all()
    assert loss.item() - base.item() == pytest.approx(0.5 * k3.sum().item(), rel=1e-5)
    assert stats["kl_mean"] == pytest.approx(k3.mean().item(), rel=1e-5)


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped"),
    [(1.5, 1.0, True), (0.5, -1.0, True), (0.5, 1.0, False), (1.5, -1.0, False), (1.1, 1.0, False)],
)
def test_grpo_clipping_engages_beyond_eps_and_stops_the_gradient(
    ratio: float, adv: float, clipped: bool
) -> None:
    old = torch.full((1, 2), -1.0)
    new = (old + math.log(ratio)).requires_grad_()
    mask = torch.tensor([[True, False]])
    loss, stats = grpo_loss(new, old, old, torch.tensor([adv]), mask, clip_eps=0.2, kl_coef=0.0)
    loss.backward()
    assert stats["clip_fraction"] == (1.0 if clipped else 0.0)
    assert stats["ratio_mean"] == pytest.approx(ratio)
    expected_grad = 0.0 if clipped else -adv * ratio
    assert new.grad[0, 0].item() == pytest.approx(expected_grad, abs=1e-6)
    assert new.grad[0, 1].item() == 0.0


def test_grpo_ignores_masked_tokens_and_checks_shapes() -> None:
    logp, mask, adv = _grpo_inputs()
    poisoned = logp.clone()
    poisoned[~mask] = float("nan")
    a, sa = grpo_loss(logp, logp * 0.9, logp * 1.1, adv, mask, 0.2, 0.1)
    b, sb = grpo_loss(poisoned, logp * 0.9, logp * 1.1, adv, mask, 0.2, 0.1)
    assert a.item() == pytest.approx(b.item()) and sa == pytest.approx(sb)
    empty, stats = grpo_loss(logp, logp, logp, adv, torch.zeros_like(mask), 0.2, 0.1)
    assert empty.item() == 0.0 and stats["ratio_mean"] == 0.0
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, logp, logp, adv[:2], mask, 0.2, 0.1)
