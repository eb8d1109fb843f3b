"""Grouped SwiGLU experts with `torch._grouped_mm`: one grouped GEMM per projection for all
experts, the group boundaries given as int32 offsets on the device. Picked on CPU and CUDA
(priority 2).

CUDA sm90+ with bf16: PyTorch's CUTLASS grouped GEMM, which reads the offsets on the device, so
the expert computation has no host sync at all. CPU: PyTorch's `_grouped_mm` loops over the
groups in C++ (offsets read in C++, free on a CPU); measured fwd+bwd of the MoE layer (4096
tokens, dim 512, hidden 256, top-8) it is on par with the loop at 8-64 experts and 1.0-1.13x
faster at 256, while the padded bmm (padded.py) is 0.8x the loop, so this is CPU's default.
(On an oversubscribed CPU, where every small parallel op waits for descheduled threads, the
padded bmm's few big ops win by far; a training rank that owns its cores is not that case.)

Requirements (`gmm_supported`; other inputs take the padded path): both operands of one dtype
(under autocast they are cast to the autocast dtype here, since autocast does not cover
`_grouped_mm`); row strides multiples of 16 bytes (dim and hidden multiples of 4 in fp32, 8 in
bf16); on CUDA, bf16 on sm90+ (older GPUs have only PyTorch's syncing fallback, so they take
the padded path). Autograd is PyTorch's own `_grouped_mm` backward, which needs a densely
strided output gradient: a hook on the output (`_dense_grad`) makes it so (`y.sum().backward()` gives a stride-0 one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.registry import register

_ALIGN = 16  # bytes


def autocast_operands(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast to the autocast dtype when autocast is on for these tensors' device (what autocast
    would do for a matmul); else unchanged."""
    dev = ts[0].device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) for t in ts)


def gmm_supported(tokens: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `_grouped_mm` takes these operands on their device (after autocast casting)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dt, dev = tokens.dtype, tokens.device.type
    if any(w.dtype != dt for w in weights):
        return False
    if dev == "cuda":
        ok_dtype = dt == torch.bfloat16 and torch.cuda.get_device_capability(tokens.device) >= (
            9,
            0,
        )
    elif dev == "cpu":
        ok_dtype = dt in (torch.float32, torch.bfloat16, torch.float16)
    else:
        return False
    align = _ALIGN // tokens.element_size()
    return ok_dtype and all(
        t.shape[-1] % align == 0 and t.data_ptr() % _ALIGN == 0 for t in (tokens, *weights)
    )


def _dense_grad(g: torch.Tensor) -> torch.Tensor:
    """The gradient of the grouped GEMM's output, made contiguous and 16-byte aligned (its
    backward requires both). A hook on the output rather than an identity autograd.Function:
    that returned a view, and FSDP2 warns about (and drops hooks on in-place ops on) views
    returned by a wrapped module."""
    dense = g.dim() < 2 or (g.stride(-1) == 1 and g.stride(-2) == g.shape[-1])
    if dense and g.data_ptr() % _ALIGN == 0:
        return g
    # (an empty stride-0 tensor counts as contiguous: .contiguous() would keep it)
    return torch.empty_like(g, memory_format=torch.contiguous_format).copy_(g)


def gmm_swiglu(tokens, counts, w1, w3, w2):
    """The grouped-GEMM computation; operands must satisfy `gmm_supported`."""
    offs = counts.cumsum(0).to(torch.int32)
    x = tokens.contiguous()
    h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
    y = torch._grouped_mm(h, w2, offs=offs)
    if y.requires_grad:
        y.register_hook(_dense_grad)
    return y


# Run eagerly under torch.compile (a graph break, as the loop's and the padded path's host
# reads are): the fake-tensor rule of `_grouped_mm` accepts bf16 only, not the fp32 CPU kernel.
@torch.compiler.disable
def grouped_mm_swiglu(tokens, counts, w1, w3, w2):
    tokens, w1, w3, w2 = autocast_operands(tokens, w1, w3, w2)
    if gmm_supported(tokens, w1, w3, w2):
        return gmm_swiglu(tokens, counts, w1, w3, w2)
    from wanka.ops.grouped_experts.padded import padded_swiglu

    return padded_swiglu(tokens, counts, w1, w3, w2)


register(
    "grouped_swiglu",
    "grouped_mm",
    ("cpu", "cuda"),
    priority=2,
    available=lambda: hasattr(torch, "_grouped_mm"),
)(grouped_mm_swiglu)
