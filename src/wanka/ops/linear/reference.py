"""The definition: torch's F.linear (x @ weight.T + bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.registry import register


@register("linear", "reference")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
