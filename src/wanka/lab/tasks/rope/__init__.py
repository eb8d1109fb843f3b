"""RoPE task: the model's rotary embedding with per-document positions, CPU, fwd + bwd."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace
from wanka.models.layers import rope_table

HERE = Path(__file__).parent

DESCRIPTION = """\
Rotary position embedding as in wanka.models.layers.apply_rope: x [B, L, H, D] (float32);
pairs are (x[..., i], x[..., i + D/2]); each token rotates by its own position (positions
[B, L] restart at 0 at every packed document) using table [max_len, D/2, 2] of (cos, sin).
Memory-bound elementwise work; forward and backward (dx) are checked and timed.
"""


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    B, L, H, D = d["B"], d["L"], d["H"], d["D"]
    pos = torch.empty(B, L, dtype=torch.long)
    for b in range(B):  # packed documents: positions restart at random boundaries
        cuts = torch.randint(1, L, (3,), generator=gen).sort().values.tolist()
        starts = [0, *cuts]
        for s, e in zip(starts, [*cuts, L]):
            pos[b, s:e] = torch.arange(e - s)
    return {"x": torch.randn(B, L, H, D, generator=gen), "table": rope_table(D, L, 10000.0),
            "positions": pos}  # fmt: skip


SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("impl", ("cat", "out", "complex")),
        Knob("backward", ("autograd", "manual")),
        Knob("upcast", (True, False)),
    ),  # fmt: skip
    baseline={"impl": "cat", "backward": "autograd", "upcast": True},
)

CPU = Task(
    name="rope-cpu", op="rope", description=DESCRIPTION, device="cpu", mode="fwd_bwd",
    signature="kernel(x, table, positions) -> x rotated [B, L, H, D]",
    reference="wanka.models.layers:apply_rope", baseline=(HERE / "baseline.py").read_text(),
    make_inputs=make_inputs, grad_inputs=("x",), structural=("table", "positions"),
    shapes=(Shape("small", {"B": 2, "L": 64, "H": 4, "D": 32}),
            Shape("odd", {"B": 1, "L": 100, "H": 3, "D": 48})),
    timing_shape=Shape("timing", {"B": 2, "L": 2048, "H": 8, "D": 64}),
    held_out=(Shape("held-odd", {"B": 3, "L": 77, "H": 5, "D": 16}),),
    held_out_timing=Shape("held-timing", {"B": 1, "L": 3000, "H": 8, "D": 96}),
    tolerance=Tolerance(atol=1e-5, rtol=1e-4), space=SPACE,
    flops=lambda d: 12.0 * d["B"] * d["L"] * d["H"] * d["D"],
    bytes=lambda d: 4.0 * 4 * d["B"] * d["L"] * d["H"] * d["D"],
)  # fmt: skip
TASKS = (CPU,)
