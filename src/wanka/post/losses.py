"""Per-token objectives for on-policy distillation and GRPO.

Conventions shared by every distillation loss here:

* logits are already aligned with the tokens they score: ``logits[:, t]`` predicts ``targets[:, t]``;
* ``mask`` [B, T] (bool) marks the completion tokens that count. Only those rows are read (they
  are gathered before any softmax), so padding may hold anything, even inf or NaN;
* the result is ``(loss_sum, per_token)``: ``loss_sum`` is a scalar, the *sum* over masked
  tokens (the caller divides by its global token count, so micro-batches and ranks add up
  exactly), differentiable with respect to the student only; ``per_token`` [B, T] is a detached
  copy for logging, 0 where the mask is False;
* arithmetic is fp32 for bf16/fp16/fp32 logits (bf16 log-probabilities are too coarse for KLs
  between close distributions); fp64 logits stay fp64.

All are sums over tokens, so a caller short of memory can call them on slices of T and add.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _upcast(x: Tensor) -> Tensor:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 (never lose precision)."""
    return x if x.dtype == torch.float64 else x.float()


def _rows(logits: Tensor, mask: Tensor) -> Tensor:
    """The masked positions' logits as fp32 [N, V] (the only [*, V] copy a loss makes)."""
    if mask.shape != logits.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logits {tuple(logits.shape[:-1])}")
    return _upcast(logits[mask.bool()])


def _spread(values: Tensor, mask: Tensor) -> Tensor:
    """Per-token values [N] back to a detached [B, T] grid, zeros off the mask."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    out[mask.bool()] = values.detach()
    return out


def _result(per_row: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return per_row.sum(), _spread(per_row, mask)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(targets) [B, T] in fp32, without materialising the full log-softmax."""
    logits = _upcast(logits)
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _kl_rows(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) per row from log-probabilities [N, V] -> [N]."""
    return (logp.exp() * (logp - logq)).sum(-1)


def reverse_kl_exact(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """KL(p_s || p_t) = sum_v p_s (log p_s - log p_t), exact over the vocabulary.

    Mode-seeking: the student is pushed off tokens the teacher finds unlikely, which is what
    on-policy distillation wants (the student's own samples are what get corrected).
    """
    s = F.log_softmax(_rows(student_logits, mask), dim=-1)
    t = F.log_softmax(_rows(teacher_logits.detach(), mask), dim=-1)
    return _result(_kl_rows(s, t), mask)


def reverse_kl_sampled(
    student_logits: Tensor, teacher_logits: Tensor, targets: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Single-sample reverse KL at the sampled tokens x = ``targets`` (x ~ p_s).

    Per token k = log p_s(x) - log p_t(x), an unbiased estimate of KL(p_s || p_t). The gradient
    is that of the surrogate ``k.detach() * log p_s(x)``: since E_x[grad log p_s(x)] = 0,
    E_x[k grad log p_s(x)] = grad KL(p_s || p_t) exactly, so the gradient is unbiased, but only
    when x really was drawn from p_s at these logits (temperature 1, no top-k/top-p; the
    distiller samples that way). Reading V logits only through a gather + logsumexp, it is the
    cheap choice for large vocabularies; it is noisier than ``reverse_kl_exact``.

    ``loss_sum``'s *value* is sum k (a KL estimate that reads sensibly in logs); its gradient
    is the surrogate's (value and gradient are decoupled with a detached correction).
    """
    if targets.shape != mask.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != mask {tuple(mask.shape)}")
    m = mask.bool()
    x = targets[m].long().unsqueeze(-1)
    s_rows = _rows(student_logits, m)
    t_rows = _rows(teacher_logits.detach(), m)
    logp_s = s_rows.gather(-1, x).squeeze(-1) - torch.logsumexp(s_rows, dim=-1)
    logp_t = t_rows.gather(-1, x).squeeze(-1) - torch.logsumexp(t_rows, dim=-1)
    k = (logp_s - logp_t).detach()
    surrogate = k * logp_s
    loss = surrogate.sum() - surrogate.detach().sum() + k.sum()
    return loss, _spread(k, m)


def forward_kl(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """KL(p_t || p_s) = sum_v p_t (log p_t - log p_s): mass-covering (classic distillation)."""
    s = F.log_softmax(_rows(student_logits, mask), dim=-1)
    t = F.log_softmax(_rows(teacher_logits.detach(), mask), dim=-1)
    return _result(_kl_rows(t, s), mask)


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """GKD's generalized Jensen-Shannon divergence, with TRL's ``beta`` convention.

    As in TRL's ``GKDTrainer.generalized_jsd_loss`` (and its docs: "beta=0 approximates forward
    KL, beta=1 reverse KL"):

    * ``beta == 0``: forward KL(p_t || p_s), unscaled;
    * ``beta == 1``: reverse KL(p_s || p_t), unscaled;
    * otherwise, with the mixture M = beta p_t + (1 - beta) p_s:
      JSD = beta KL(p_t || M) + (1 - beta) KL(p_s || M).

    The end points are special cases, not limits: JSD(beta) -> 0 at both ends, and
    JSD(beta) / beta -> KL(p_t || p_s) as beta -> 0, JSD / (1 - beta) -> KL(p_s || p_t) as
    beta -> 1. So a small interior beta is a *scaled-down* forward-KL-like loss (its gradient is
    about beta times smaller), the same discontinuity TRL has; use the end points for the KLs.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask)
    if beta == 1.0:
        return reverse_kl_exact(student_logits, teacher_logits, mask)
    s = F.log_softmax(_rows(student_logits, mask), dim=-1)
    t = F.log_softmax(_rows(teacher_logits.detach(), mask), dim=-1)
    log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
    per_row = beta * _kl_rows(t, log_m) + (1.0 - beta) * _kl_rows(s, log_m)
    return _result(per_row, mask)


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: (r - group mean) / (group std + eps) per consecutive group.

    The std is the *population* std (divide by G, not G - 1): every group with any spread then
    gets advantages of unit root-mean-square whatever the group size, so the policy-gradient
    scale does not change with ``group_size`` (the sample std would shrink it by
    sqrt((G-1)/G), e.g. 0.71 for G = 2), and it is defined for G = 1 (advantages 0: no
    comparison, no signal). A group whose rewards are all equal gets exact zeros (a float mean
    of equal numbers need not equal them, and eps would amplify that rounding).
    """
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: {rewards.numel()} rewards do not split into groups of {group_size}"
        )
    # Normalised in float64 (rl.py's rewards are float64): in float32 a constant offset hid
    # the spread (1e8 and 1e8 + 1 are one float32 number: zero advantage, nothing learned,
    # nothing said), though GRPO is meant to be shift-invariant. The advantages (unit RMS)
    # come back float32, or float64 for float64 rewards.
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    adv = centred / (std + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv).view(-1).to(out_dtype)


def grpo_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    logp_ref: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    kl_coef: float,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO's per-token loss, summed over masked tokens.

    Per token: -min(r A, clip(r, 1 - eps, 1 + eps) A) with r = exp(logp_new - logp_old) (PPO's
    clipped surrogate; where the clipped branch is the minimum, the token gives no gradient),
    plus ``kl_coef`` times the k3 estimate of KL(new || ref) at the sampled token,
    exp(ref - new) - (ref - new) - 1 (non-negative, unbiased for samples of the new policy, low
    variance). ``advantages`` [B] is one value per sequence, shared by its tokens.

    Stats (over masked tokens, 0.0 when there are none): ``clip_fraction`` (tokens whose
    gradient the clip removed), ``kl_mean`` (mean k3), ``ratio_mean``.
    """
    if not logp_new.shape == logp_old.shape == logp_ref.shape == mask.shape:
        raise ValueError(
            "grpo_loss: logp_new/old/ref and mask must share a shape, got "
            f"{[tuple(t.shape) for t in (logp_new, logp_old, logp_ref, mask)]}"
        )
    if advantages.shape != mask.shape[:1]:
        raise ValueError(
            f"grpo_loss: advantages shape {tuple(advantages.shape)} != [{mask.shape[0]}]"
        )
    m = mask.bool()
    new = _upcast(logp_new)[m]
    old = _upcast(logp_old.detach())[m]
    ref = _upcast(logp_ref.detach())[m]
    adv = _upcast(advantages.detach()).unsqueeze(1).expand(m.shape)[m]

    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    policy = -torch.minimum(unclipped, clipped)
    d = ref - new
    k3 = torch.exp(d) - d - 1.0
    loss = (policy + kl_coef * k3).sum()

    with torch.no_grad():
        n = new.numel()
        clip_active = clipped < unclipped
        stats = {
            "clip_fraction": clip_active.float().mean().item() if n else 0.0,
            "kl_mean": k3.mean().item() if n else 0.0,
            "ratio_mean": ratio.mean().item() if n else 0.0,
        }
    return loss, stats
