"""Grouped SwiGLU experts as padded batched matmuls: every expert's rows are scattered into
an [E, C, D] buffer (C = the largest expert's row count, zero rows as padding), three `bmm`s
run all experts at once, and the real rows are gathered back.

The default (priority 1) where `_grouped_mm` has no kernel for the inputs (other devices, CUDA
before sm90 or not bf16, unaligned shapes): a handful of large ops instead of ~10 per expert.
On CPU it measured 0.8x the loop (the scatter/gather copies and the padding cost more than the
per-expert calls save), so CPU uses grouped_mm.py.

Cost: C is read on the host (one scalar device-to-host sync per call; the row permutation is
built on the device from counts, with no further sync). The padding costs (E * C / R - 1) of
extra compute and activation memory; a skewed routing could make that up to E / top_k times
the real rows, so above PAD_WASTE x (plus PAD_SLACK rows per expert) the unpadded grouped GEMM
(or the loop, where `_grouped_mm` does not take the inputs) is used instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.grouped_experts.grouped_mm import autocast_operands, gmm_supported, gmm_swiglu
from wanka.ops.grouped_experts.reference import grouped_swiglu as loop_swiglu
from wanka.ops.registry import register

PAD_WASTE = 2.0
PAD_SLACK = 32


@register("grouped_swiglu", "padded_bmm", priority=1)
def padded_swiglu(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    R, E = tokens.shape[0], counts.shape[0]
    cap = int(counts.max()) if E else 0  # the one host sync of this path
    if E * cap > PAD_WASTE * R + PAD_SLACK * E:
        cast = autocast_operands(tokens, w1, w3, w2)
        if gmm_supported(*cast):
            return gmm_swiglu(cast[0], counts, *cast[1:])
        return loop_swiglu(tokens, counts, w1, w3, w2)
    dev = tokens.device
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(E, device=dev), counts, output_size=R)
    slot = expert * cap + torch.arange(R, device=dev) - starts[expert]
    D = tokens.shape[-1]
    xp = tokens.new_zeros((E * cap, D)).index_copy(0, slot, tokens).view(E, cap, D)
    h = F.silu(torch.bmm(xp, w1)) * torch.bmm(xp, w3)
    y = torch.bmm(h, w2)
    return y.view(E * cap, y.shape[-1]).index_select(0, slot)
