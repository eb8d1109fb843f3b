"""RMSNorm tasks: the model's normalisation layer, CPU (fwd + bwd) and Triton (fwd)."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace

HERE = Path(__file__).parent

DESCRIPTION = """\
RMSNorm as in wanka.models.layers.RMSNorm: y = x / sqrt(mean(x^2, last dim) + eps) * weight,
statistics in float32. x [N, D] float32, weight [D], eps float. Memory-bound: one read of x,
one write of y (and the same again for the backward).
"""


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model layer's forward, as a function (same operations, same order)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    return {"x": torch.randn(d["N"], d["D"], generator=gen),
            "weight": 1.0 + 0.1 * torch.randn(d["D"], generator=gen), "eps": 1e-6}  # fmt: skip


def _flops(d: dict[str, int], mode: str) -> float:
    return (4.0 if mode == "fwd" else 12.0) * d["N"] * d["D"]


def _bytes(d: dict[str, int], mode: str) -> float:
    return (2.0 if mode == "fwd" else 5.0) * 4 * d["N"] * d["D"]


CPU_SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("impl", ("upcast", "native", "fused")),
        Knob("backward", ("autograd", "manual")),
        Knob("rows", (0, 256, 1024, 4096), ordered=True),
        Knob("inv", ("rsqrt", "div")),
    ),  # fmt: skip
    baseline={"impl": "upcast", "backward": "autograd", "rows": 0, "inv": "rsqrt"},
)
TRITON_SPACE = VariantSpace(
    template=(HERE / "template_triton.py").read_text(),
    knobs=(Knob("rows", (1, 2, 4, 8), ordered=True), Knob("num_warps", (1, 2, 4, 8), ordered=True)),
    baseline={"rows": 1, "num_warps": 4},
)
SHAPES = (Shape("small", {"N": 64, "D": 256}), Shape("odd", {"N": 100, "D": 384}))
HELD_OUT = (Shape("held-odd", {"N": 77, "D": 200}), Shape("held-wide", {"N": 9, "D": 1000}))
_COMMON = dict(
    op="rms_norm", description=DESCRIPTION, signature="kernel(x, weight, eps) -> y [N, D]",
    reference="wanka.lab.tasks.rmsnorm:reference", make_inputs=make_inputs,
    structural=("eps",), shapes=SHAPES, held_out=HELD_OUT,
)  # fmt: skip

# atol 1e-4 (rtol 1e-4): the weight's gradient sums every row (N up to 4096), and float32
# summation order alone moves it by ~1e-5-1e-4; every timed call is checked against it.
CPU = Task(
    name="rmsnorm-cpu", device="cpu", mode="fwd_bwd", grad_inputs=("x", "weight"),
    baseline=(HERE / "baseline.py").read_text(),
    timing_shape=Shape("timing", {"N": 4096, "D": 1024}),
    held_out_timing=Shape("held-timing", {"N": 3000, "D": 1536}),
    tolerance=Tolerance(atol=1e-4, rtol=1e-4), space=CPU_SPACE,
    flops=lambda d: _flops(d, "fwd_bwd"), bytes=lambda d: _bytes(d, "fwd_bwd"), **_COMMON,
)  # fmt: skip
TRITON = Task(
    name="rmsnorm-triton", device="cuda", needs="triton", mode="fwd", grad_inputs=(),
    baseline=(HERE / "baseline.py").read_text(),
    timing_shape=Shape("timing", {"N": 16384, "D": 4096}),
    held_out_timing=Shape("held-timing", {"N": 12000, "D": 5120}),
    tolerance=Tolerance(atol=1e-4, rtol=1e-4), space=TRITON_SPACE,
    flops=lambda d: _flops(d, "fwd"), bytes=lambda d: _bytes(d, "fwd"), **_COMMON,
)  # fmt: skip
TASKS = (CPU, TRITON)
