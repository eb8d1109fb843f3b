"""Grouped SwiGLU experts: rows grouped by expert, each group through its own expert.

`grouped_swiglu(tokens [R, D], counts [E], w1 [E, D, H], w3 [E, D, H], w2 [E, H, D]) -> [R, D]`
where rows counts[0] come first (expert 0), then counts[1] rows (expert 1), ...;
sum(counts) == R. Row r of expert e: (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e].
counts is an integer tensor (on the tokens' device): backends that need no host copy of it
keep the layer free of device-to-host syncs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.registry import register


@register("grouped_swiglu", "reference")
def grouped_swiglu(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The plain loop over experts (reads counts on the host).

    split/unbind rather than slicing/indexing: their backward is one cat/stack, while the
    backward of `tokens[a:b]` / `w1[e]` writes a zero-filled full-size gradient per expert
    (O(E * R * D) and O(E^2 * D * H) work: minutes per step at 256 experts)."""
    xs = tokens.split(counts.tolist())
    outs = [
        (F.silu(x @ a) * (x @ b)) @ c
        for x, a, b, c in zip(xs, w1.unbind(0), w3.unbind(0), w2.unbind(0), strict=True)
    ]
    return torch.cat(outs) if outs else tokens.new_zeros((0, w2.shape[-1]))
