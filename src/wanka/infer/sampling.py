"""Token choice: greedy, temperature and top-p (nucleus), and the speculative acceptance rules.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft token x drawn from
the draft distribution q is kept with probability min(1, p(x) / q(x)), p the target's; on
rejection the token is drawn from norm(max(0, p - q)). The output then follows p exactly,
whatever q is. Greedy decoding keeps a draft iff it is the target's argmax, so the output is
the one plain greedy decoding gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} is not a finite number >= 0: use 0 "
                             "(greedy) or e.g. 0.8")  # fmt: skip
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} is not in (0, 1]: use e.g. 0.9, or 1 (off)")

    @property
    def greedy(self) -> bool:
        # Below float32's smallest normal number a temperature is 0 in the fp32 arithmetic
        # below (0 / 0 at the argmax): it means greedy anyway.
        return self.temperature < torch.finfo(torch.float32).tiny


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> the distribution tokens are drawn from (fp32): temperature, then the
    smallest set of most likely tokens whose mass reaches top_p. Greedy: one-hot argmax."""
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # The max first: a tiny temperature then gives -inf (not inf - inf = nan) off the argmax.
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        cut = before >= sampling.top_p
        cut[..., 0] = False  # the most likely token always stays (a top_p of 1e-300 is 0 here)
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [B, V] -> [B]."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def accept_drafts(target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor,
                  gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Speculative acceptance for a batch.

    target [B, N + 1, V]: the target's distribution at each draft position and one beyond;
    draft [B, N, V]: the distributions the drafts were drawn from; drafts [B, N].
    -> (accepted [B]: how many leading drafts each row keeps, next [B]: the token after them,
    from the residual distribution where a draft was rejected, else from target[:, N])."""
    B, N = drafts.shape
    p = target[:, :N].gather(-1, drafts[..., None]).squeeze(-1)
    q = draft.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, N, generator=gen, device=drafts.device)
    ok = u * q < p  # u < p / q without dividing by a zero q (then ok iff p > 0)
    accepted = torch.cumprod(ok.long(), dim=-1).sum(-1)  # leading run of kept drafts
    rows = torch.arange(B, device=drafts.device)
    at = target[rows, accepted]  # [B, V]: the target where the run stopped
    stopped = accepted < N
    residual = (at - draft[rows, accepted.clamp(max=N - 1)]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # A rejected draft means p(x) < q(x) somewhere, so the residual has mass; guard rounding.
    use_residual = stopped[:, None] & (mass > 0)
    probs = torch.where(use_residual, residual / mass.clamp(min=1e-30), at)
    return accepted, draw(probs, gen)
