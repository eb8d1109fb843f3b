"""Sparse attention tasks (DSA core: MQA over the indexer's top-k keys), CPU and Triton."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace
from wanka.ops.index_patterns import random_indices, realistic_indices

HERE = Path(__file__).parent

DESCRIPTION = """\
Sparse attention of DeepSeek Sparse Attention (DSA), MQA form: each query t attends only to
the K keys its lightning indexer selected. q [B, L, H, D]; k, v [B, L, D] (one key/value
head shared by the H query heads); indices [B, L, K] int64, -1 marks an empty slot, every
valid index is a key the query may see, each row has at least one valid slot; scale float.
out[b, t, h] = softmax_j(scale * q[b, t, h] . k[b, indices[b, t, j]]) @ v[b, indices[...]],
empty slots excluded; softmax accumulated in float32. Forward and backward (dq, dk, dv) are
checked and timed together. Index patterns: `realistic` (local window + shared heavy hitters
+ a few random keys, what a trained indexer picks) and `random` (uniform, the worst case).
"""


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    B, L, K, H, D = d["B"], d["L"], d["K"], d["H"], d["D"]
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    pattern = random_indices if d.get("random") else realistic_indices
    return {
        "q": torch.randn(B, L, H, D, generator=gen),
        "k": torch.randn(B, L, D, generator=gen),
        "v": torch.randn(B, L, D, generator=gen),
        "indices": pattern(B, L, K, seed=seed),
        "scale": D**-0.5,
    }


def _visible_keys(d: dict[str, int]) -> float:
    """Valid slots over all queries (query t sees t + 1 keys at most): the work done."""
    L, K = d["L"], min(d["K"], d["L"])
    return d["B"] * (K * (K + 1) / 2 + (L - K) * K)


def flops(d: dict[str, int]) -> float:
    # forward q.k and p.v (4 HD per slot); backward dp, dq, dk, dv (8 HD, scores recomputed
    # or stored: the minimum counts neither)
    return 12.0 * _visible_keys(d) * d["H"] * d["D"]


def bytes_moved(d: dict[str, int]) -> float:
    B, L, H, D, K = d["B"], d["L"], d["H"], d["D"], d["K"]
    return 4.0 * (4 * B * L * H * D + 4 * B * L * D) + 8.0 * B * L * K


SHAPES = (
    Shape("small-realistic", {"B": 2, "L": 256, "K": 64, "H": 4, "D": 64}),
    Shape("small-random", {"B": 1, "L": 384, "K": 96, "H": 4, "D": 64, "random": 1}),
)
TIMING = Shape("timing", {"B": 1, "L": 640, "K": 160, "H": 4, "D": 64})
HELD_OUT = (
    Shape("held-odd", {"B": 1, "L": 517, "K": 120, "H": 2, "D": 32}),
    Shape("held-random", {"B": 2, "L": 300, "K": 50, "H": 3, "D": 48, "random": 1}),
)
HELD_TIMING = Shape("held-timing", {"B": 1, "L": 900, "K": 224, "H": 4, "D": 64})

CPU_SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("algo", ("gather_full", "gather", "union", "hybrid")),
        Knob(
            "chunk",
            (16, 24, 32, 48, 64, 96, 128, 192, 256),
            ordered=True,
            when={"algo": ("gather", "union", "hybrid")},
        ),
        Knob("divisor", (1.25, 1.5, 2.0, 3.0, 4.0), ordered=True, when={"algo": ("hybrid",)}),
        Knob("backward", ("recompute", "autograd"), when={"algo": ("gather", "union", "hybrid")}),
        Knob("take", ("index_select", "index", "embedding")),
        Knob("dtype", ("float32", "bfloat16")),
        Knob("scale_at", ("q", "scores")),
    ),  # fmt: skip
    baseline={
        "algo": "gather_full",
        "take": "index_select",
        "dtype": "float32",
        "scale_at": "scores",
        "chunk": 16,
        "divisor": 1.25,
        "backward": "recompute",
    },  # fmt: skip
)

TRITON_SPACE = VariantSpace(
    template=(HERE / "template_triton.py").read_text(),
    knobs=(
        Knob("block_k", (16, 32, 64, 128), ordered=True),
        Knob("num_warps", (1, 2, 4, 8), ordered=True),
        Knob("num_stages", (1, 2, 3, 4), ordered=True),
    ),
    baseline={"block_k": 32, "num_warps": 4, "num_stages": 2},
)

_COMMON = dict(
    op="sparse_attention",
    description=DESCRIPTION,
    mode="fwd_bwd",
    signature="kernel(q, k, v, indices, scale) -> out [B, L, H, D]",
    reference="wanka.ops.sparse_attention.reference:sparse_attention",
    make_inputs=make_inputs,
    grad_inputs=("q", "k", "v"),
    structural=("indices", "scale"),
    flops=flops,
    bytes=bytes_moved,
)

CPU = Task(
    name="sparse_attention-cpu",
    device="cpu",
    baseline=(HERE / "baseline.py").read_text(),
    shapes=SHAPES,
    timing_shape=TIMING,
    held_out=HELD_OUT,
    held_out_timing=HELD_TIMING,
    tolerance=Tolerance(atol=2e-4, rtol=2e-3),
    space=CPU_SPACE,
    **_COMMON,
)

TRITON = Task(
    name="sparse_attention-triton",
    device="cuda",
    needs="triton",
    baseline_is_reference=False,
    baseline="from wanka.ops.sparse_attention.triton import sparse_attention as kernel  # noqa: F401\n",
    shapes=SHAPES,
    timing_shape=Shape("timing", {"B": 1, "L": 8192, "K": 1024, "H": 16, "D": 64}),
    held_out=HELD_OUT,
    held_out_timing=Shape("held-timing", {"B": 1, "L": 6000, "K": 700, "H": 16, "D": 64}),
    tolerance=Tolerance(atol=5e-4, rtol=5e-3),
    space=TRITON_SPACE,
    **_COMMON,
)

TASKS = (CPU, TRITON)
