"""MoE dispatch/combine task: token permutation to experts and back, CPU, fwd + bwd."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace
from wanka.ops.moe_dispatch.reference import moe_permute, moe_unpermute

HERE = Path(__file__).parent

DESCRIPTION = """\
MoE token dispatch and combine around a stand-in expert. x [N, D] float32 tokens,
expert_idx [N, k] int64 (the router's top-k experts, distinct per token), weights [N, k]
(gate weights), expert_scale [E, D] (expert e multiplies its rows elementwise by
expert_scale[e]). out[n] = sum_j weights[n, j] * x[n] * expert_scale[expert_idx[n, j]],
computed the way an MoE layer does: group token copies by expert (dispatch), apply each
expert to its contiguous group, put results back and take the weighted sum (combine).
Gradients w.r.t. x, weights and expert_scale are checked and timed.
"""


def reference(x, expert_idx, weights, expert_scale):
    """wanka.ops.moe_dispatch's reference permute/unpermute around the stand-in expert."""
    grouped, counts, order = moe_permute(x, expert_idx, expert_scale.shape[0])
    experts = expert_idx.reshape(-1)[order]
    return moe_unpermute(grouped * expert_scale[experts], order, weights)


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    N, D, k, E = d["N"], d["D"], d["k"], d["E"]
    idx = torch.rand(N, E, generator=gen).topk(k, dim=1).indices
    return {"x": torch.randn(N, D, generator=gen), "expert_idx": idx,
            "weights": torch.rand(N, k, generator=gen),
            "expert_scale": torch.randn(E, D, generator=gen)}  # fmt: skip


SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("sort", ("stable", "unstable", "counting")),
        Knob("combine", ("copy_einsum", "index_add", "unsort")),
        Knob("scale", ("gather", "segments")),
    ),  # fmt: skip
    baseline={"sort": "stable", "combine": "copy_einsum", "scale": "gather"},
)

CPU = Task(
    name="moe_dispatch-cpu", op="moe_dispatch_combine", description=DESCRIPTION, device="cpu",
    mode="fwd_bwd", signature="kernel(x, expert_idx, weights, expert_scale) -> out [N, D]",
    reference="wanka.lab.tasks.moe_dispatch:reference",
    baseline=(HERE / "baseline.py").read_text(), make_inputs=make_inputs,
    grad_inputs=("x", "weights", "expert_scale"), structural=("expert_idx",),
    shapes=(Shape("small", {"N": 256, "D": 128, "k": 4, "E": 16}),
            Shape("odd", {"N": 99, "D": 72, "k": 3, "E": 7})),
    timing_shape=Shape("timing", {"N": 4096, "D": 512, "k": 6, "E": 64}),
    held_out=(Shape("held-odd", {"N": 333, "D": 96, "k": 3, "E": 10}),
              Shape("held-top1", {"N": 50, "D": 40, "k": 1, "E": 5})),
    held_out_timing=Shape("held-timing", {"N": 3000, "D": 768, "k": 8, "E": 32}),
    tolerance=Tolerance(atol=1e-4, rtol=1e-4), space=SPACE,
    flops=lambda d: 3.0 * 3 * d["N"] * d["k"] * d["D"],
    bytes=lambda d: 4.0 * (4 * d["N"] * d["D"] + 2 * d["E"] * d["D"]),
)  # fmt: skip
TASKS = (CPU,)
