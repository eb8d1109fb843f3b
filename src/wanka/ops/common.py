"""Helpers shared by op backends."""

from __future__ import annotations

import os

import torch

POISON_ENV = "WANKA_OPS_POISON"


def new_output(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Uninitialised output buffer; poisoned when WANKA_OPS_POISON=1 (NaN, or the integer
    minimum for index buffers) so that tests catch any element a kernel forgets to write
    (torch.empty may happen to hold plausible values)."""
    if os.environ.get(POISON_ENV) == "1":
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
