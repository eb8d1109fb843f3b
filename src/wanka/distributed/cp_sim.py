"""Simulated CP steps: compare layouts by modelled cost at any rank count, no devices needed.

Each step draws packed rows the way the packed loader makes them (documents sampled with
replacement from a length distribution, concatenated, cut at row ends into fragments),
plans it, and records the max and mean modelled rank cost. Only piece arrays are used (no
per-rank layouts or key indices), so 1024 ranks x 20 steps take seconds.
"""

from __future__ import annotations

import numpy as np

from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_plan import plan_step


def draw_rows(
    rng: np.random.Generator, doc_lengths: np.ndarray, n_rows: int, seq_len: int
) -> list[list[int]]:
    """``n_rows`` packed rows of ``seq_len`` tokens as fragment lengths."""
    total = n_rows * seq_len
    draws, covered = [], 0
    while covered < total:
        draw = rng.choice(doc_lengths, size=int(1.2 * total / doc_lengths.mean()) + 16)
        draws.append(draw)
        covered += int(draw.sum())
    ends = np.cumsum(np.concatenate(draws))
    cuts = np.union1d(ends[ends < total], np.arange(0, total + 1, seq_len))
    frags = np.diff(cuts)
    row = cuts[:-1] // seq_len
    bounds = np.searchsorted(row, np.arange(n_rows + 1))
    return [frags[bounds[i] : bounds[i + 1]].tolist() for i in range(n_rows)]


def simulate(
    doc_lengths: np.ndarray,
    seq_len: int,
    ranks: int,
    cp: int,
    layout: str,
    cost: CostModel,
    steps: int,
    seed: int,
    rows_per_group: int = 1,
    **plan_kwargs,
) -> dict:
    """Per-step max/mean rank cost of ``layout`` on ``ranks`` = dp x cp ranks.

    ``throughput``: tokens per unit of modelled time (each step takes its slowest rank);
    ``efficiency``: mean / max cost summed over steps (1.0 = perfectly balanced).
    """
    if ranks % cp != 0:
        raise ValueError(f"ranks={ranks} is not a multiple of cp={cp}")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    dp = ranks // cp
    rng = np.random.default_rng(seed)
    max_cost, mean_cost, bound, gather, lmax_ratio, spans = [], [], [], [], [], []
    for _ in range(steps):
        rows = draw_rows(rng, lengths, dp * rows_per_group, seq_len)
        groups = [rows[g * rows_per_group : (g + 1) * rows_per_group] for g in range(dp)]
        plan = plan_step(groups, cp, layout, cost, **plan_kwargs)
        c = plan.rank_costs(cost)
        max_cost.append(float(c.max()))
        mean_cost.append(float(c.mean()))
        # No plan beats the mean; one that keeps each document inside a CP group (contiguous,
        # head_tail, dynamic at span cp) cannot beat the largest document spread over cp ranks.
        biggest = float(cost.doc_cost(plan.doc_table[:, 2]).max()) / cp
        bound.append(max(float(c.mean()), biggest))
        spans.append(plan.span)
        gather.append(float(plan.needs_gather.mean()))
        lmax_ratio.append(float(plan.lmax.max() / plan.tokens_per_rank().mean()))
    tokens = steps * dp * rows_per_group * seq_len
    imbalance = np.array(max_cost) / np.array(mean_cost)
    return {
        "layout": layout,
        "ranks": ranks,
        "cp": cp,
        "dp": dp,
        "seq_len": seq_len,
        "steps": steps,
        "max_cost": max_cost,
        "mean_cost": mean_cost,
        "imbalance": imbalance.tolist(),
        "mean_imbalance": float(imbalance.mean()),
        "throughput": tokens / sum(max_cost),
        "efficiency": sum(mean_cost) / sum(max_cost),
        "bound_imbalance": float(np.mean(np.array(bound) / np.array(mean_cost))),
        "mean_span": float(np.mean(spans)),  # ranks per gather block (cp unless widened)
        "gather_fraction": float(np.mean(gather)),  # CP groups that must all-gather keys
        "lmax_over_mean_tokens": float(np.max(lmax_ratio)),  # gather padding / memory peak
    }
