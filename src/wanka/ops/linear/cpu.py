"""CPU linear for the few rows of decoding.

A decode step projects 1 row per sequence, a speculative verify 1 + N (N drafts). For
2-5 rows the CPU BLAS's x @ W.T runs on one thread (it splits work over the rows), so a
3-token verify costs ~3x a 1-token step on 2 threads (512 x 512: 39 vs 15 us, 2-core EPYC,
MKL, torch 2.13). Oriented as (W @ x.T).T the long side is the split one and both threads
work: 31 us (1536 x 512: 127 -> 95 us; 4 rows 147 -> 78 us). From 6 rows the BLAS
splits x @ W.T well itself, at 1 row it is a matrix-vector product either way, and on one
thread the reorientation is slower (39 -> 60 us), so everything else is F.linear. Values
differ from F.linear only in summation order (fp32 rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.registry import register

FEW_ROWS = (2, 5)  # inclusive range of rows where (W @ x.T).T wins, measured as above


@register("linear", "cpu", device_types=("cpu",), priority=10)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        torch.compiler.is_compiling()  # one traced graph: let the compiler pick the GEMM
        or not FEW_ROWS[0] <= rows <= FEW_ROWS[1]
        or torch.get_num_threads() < 2
        or weight.dim() != 2  # F.linear also takes a weight [in]; the reorientation does not
    ):
        return F.linear(x, weight, bias)
    # contiguous: callers may view the output as F.linear's (a copy of 2-5 rows, ~free)
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
