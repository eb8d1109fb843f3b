"""Dense causal attention tasks (MQA, document masking), CPU and Triton, fwd + bwd."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace

HERE = Path(__file__).parent

DESCRIPTION = """\
Dense causal attention, MQA form, with packed-document masking: q [B, L, H, D]; k, v
[B, L, D] (one key/value head shared by the H query heads); doc_ids [B, L] int, non-decreasing
(contiguous documents); query t sees key s iff s <= t and both are in the same document;
softmax in float32; scale float. Forward and backward (dq, dk, dv) are checked and timed.
"""


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    B, L, H, D = d["B"], d["L"], d["H"], d["D"]
    docs = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in torch.randint(1, L, (d.get("docs", 1) - 1,), generator=gen).tolist():
            docs[b, c:] += 1
    return {"q": torch.randn(B, L, H, D, generator=gen), "k": torch.randn(B, L, D, generator=gen),
            "v": torch.randn(B, L, D, generator=gen), "doc_ids": docs, "scale": D**-0.5}  # fmt: skip


def flops(d: dict[str, int]) -> float:
    return 12.0 * d["B"] * d["L"] * (d["L"] + 1) / 2 / d.get("docs", 1) * d["H"] * d["D"]


def bytes_moved(d: dict[str, int]) -> float:
    return 4.0 * (4 * d["B"] * d["L"] * d["H"] * d["D"] + 4 * d["B"] * d["L"] * d["D"])


CPU_SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("algo", ("materialised", "sdpa_docs", "sdpa_mask", "chunked")),
        Knob("kv", ("expand", "repeat"), when={"algo": ("sdpa_docs", "sdpa_mask")}),
        Knob("chunk", (64, 128, 256, 512), ordered=True, when={"algo": ("chunked",)}),
    ),  # fmt: skip
    baseline={"algo": "materialised", "kv": "expand", "chunk": 64},
)
TRITON_SPACE = VariantSpace(
    template=(HERE / "template_triton.py").read_text(),
    knobs=(
        Knob("block", (16, 32, 64, 128), ordered=True),
        Knob("num_warps", (2, 4, 8), ordered=True),
        Knob("num_stages", (1, 2, 3, 4), ordered=True),
    ),  # fmt: skip
    baseline={"block": 64, "num_warps": 4, "num_stages": 2},
)
SHAPES = (Shape("small", {"B": 2, "L": 96, "H": 4, "D": 32, "docs": 3}),
          Shape("odd", {"B": 1, "L": 131, "H": 2, "D": 48}))  # fmt: skip
HELD_OUT = (Shape("held-docs", {"B": 1, "L": 200, "H": 3, "D": 16, "docs": 5}),)
_COMMON = dict(
    op="dense_attention", description=DESCRIPTION, mode="fwd_bwd",
    signature="kernel(q, k, v, doc_ids, scale) -> out [B, L, H, D]",
    reference="wanka.ops.dense_attention.reference:dense_attention", make_inputs=make_inputs,
    grad_inputs=("q", "k", "v"), structural=("doc_ids", "scale"), shapes=SHAPES,
    held_out=HELD_OUT, flops=flops, bytes=bytes_moved,
)  # fmt: skip
CPU = Task(
    name="dense_attention-cpu", device="cpu", baseline=(HERE / "baseline.py").read_text(),
    timing_shape=Shape("timing", {"B": 1, "L": 1024, "H": 4, "D": 64, "docs": 2}),
    held_out_timing=Shape("held-timing", {"B": 1, "L": 1500, "H": 4, "D": 64, "docs": 3}),
    tolerance=Tolerance(atol=2e-4, rtol=2e-3), space=CPU_SPACE, **_COMMON,
)  # fmt: skip
TRITON = Task(
    name="dense_attention-triton", device="cuda", needs="triton", baseline_is_reference=False,
    baseline="from wanka.ops.dense_attention.triton import dense_attention as kernel  # noqa: F401\n",
    timing_shape=Shape("timing", {"B": 1, "L": 8192, "H": 16, "D": 64, "docs": 2}),
    held_out_timing=Shape("held-timing", {"B": 2, "L": 5000, "H": 16, "D": 64, "docs": 3}),
    tolerance=Tolerance(atol=5e-4, rtol=5e-3), space=TRITON_SPACE, **_COMMON,
)  # fmt: skip
TASKS = (CPU, TRITON)
