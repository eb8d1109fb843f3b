"""Helpers shared by op backends."""

from __future__ import annotations

import os

import torch

POISON_ENV = "WANKA_OPS_POISON"


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32 for the softmax of 16-bit inputs, kept as is when it is wider: `.float()`
    would round float64 down to float32 (float64 runs, gradcheck, lose their precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def new_output(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Uninitialised output buffer; poisoned when WANKA_OPS_POISON=1 (NaN, or the integer
    minimum for index buffers) so that tests catch any element a kernel forgets to write
    (torch.empty may happen to hold plausible values)."""
    if os.environ.get(POISON_ENV) == "1":
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
