"""What the Triton backends share: the optional import and small launch helpers.

Triton is optional (the CPU-only CI may lack it): without it HAVE_TRITON is False, the
backends define no kernels and register as unavailable.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = tl = None
    HAVE_TRITON = False


def pow2(n: int, lo: int = 16) -> int:
    """Next power of two >= n and >= lo (tl.dot needs dims of at least 16)."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE dots for float32/64 inputs (exact vs the reference); TF32 for 16-bit inputs."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
