"""Lightning indexer task: DSA's top-k key selector, CPU, fwd + bwd (through the scores)."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.lab.task import Knob, Shape, Task, Tolerance, VariantSpace

HERE = Path(__file__).parent

DESCRIPTION = """\
Lightning indexer of DeepSeek Sparse Attention: score(t, s) = sum_j w[t, j] * ReLU(q[t, j] .
k[s]) over Hi indexer heads; q [B, L, Hi, Di], k [B, L, Di], w [B, L, Hi]; doc_ids [B, L]
non-decreasing; topk int. Per query, the top-k visible keys (s <= t, same document) ->
(indices [B, L, topk] int64, -1 in empty slots; their scores [B, L, topk], -inf in empty
slots), sorted by descending score; among equal scores the most recent key wins. Gradients
of the scores w.r.t. q, k, w are checked and timed. Equal scores may be listed in any order.
"""


def make_inputs(d: dict[str, int], gen: torch.Generator) -> dict:
    B, L, Hi, Di = d["B"], d["L"], d["Hi"], d["Di"]
    docs = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in torch.randint(1, L, (d.get("docs", 1) - 1,), generator=gen).tolist():
            docs[b, c:] += 1
    return {"q": torch.randn(B, L, Hi, Di, generator=gen), "k": torch.randn(B, L, Di, generator=gen),
            "w": torch.randn(B, L, Hi, generator=gen), "doc_ids": docs, "topk": d["K"]}  # fmt: skip


def compare(ref, got, inputs, tol) -> tuple[bool, str, float]:
    """Same selected set per query (order among equal scores is free), each key's score and
    the gradients within tolerance. Scores are compared in key order, so a reordering of ties
    passes and a score moved to another key does not."""
    from wanka.lab.evaluator import compare as default

    if len(got) != len(ref):
        return False, f"expected {len(ref)} results, got {len(got)}", float("inf")
    ri, gi = ref[0].cpu(), got[0].cpu()
    if gi.dtype != ri.dtype or gi.shape != ri.shape:
        return False, f"indices: {gi.dtype} {tuple(gi.shape)}, expected {ri.dtype} {tuple(ri.shape)}", float("inf")  # fmt: skip
    bad = (gi.sort(-1).values != ri.sort(-1).values).any(-1)
    if bool(bad.any()):
        return False, f"indices: {int(bad.sum())} queries select other keys", float("inf")
    rs, gs = ref[1].detach().cpu(), got[1].detach().cpu()
    if gs.shape == rs.shape and gs.dtype == rs.dtype:
        if bool((gs[..., 1:] > gs[..., :-1]).any()):
            return False, "scores: not sorted by descending score", float("inf")
        # Each score must stay with its key (the indexer's KL pairs them): compare the scores
        # in key order, so only the order of the pairs is free.
        rs = rs.gather(-1, ri.argsort(dim=-1, stable=True))
        gs = gs.gather(-1, gi.argsort(dim=-1, stable=True))
    return default((rs, *ref[2:]), (gs, *got[2:]), ["scores", "grad_q", "grad_k", "grad_w"],
                   tol.atol, tol.rtol)  # fmt: skip


SPACE = VariantSpace(
    template=(HERE / "template_cpu.py").read_text(),
    knobs=(
        Knob("algo", ("full", "chunked")),
        Knob("chunk", (64, 128, 256, 512), ordered=True, when={"algo": ("chunked",)}),
        Knob("grad", ("gather", "recompute")),
        Knob("select", ("sort", "topk")),
    ),  # fmt: skip
    baseline={"algo": "full", "chunk": 64, "grad": "gather", "select": "sort"},
)

CPU = Task(
    name="lightning_indexer-cpu", op="lightning_indexer", description=DESCRIPTION, device="cpu",
    mode="fwd_bwd", signature="kernel(q, k, w, doc_ids, topk) -> (indices, scores)",
    reference="wanka.ops.lightning_indexer.reference:lightning_indexer",
    baseline=(HERE / "baseline.py").read_text(), make_inputs=make_inputs,
    grad_inputs=("q", "k", "w"), structural=("doc_ids", "topk"),
    shapes=(Shape("small", {"B": 2, "L": 96, "K": 16, "Hi": 4, "Di": 32, "docs": 2}),
            Shape("odd", {"B": 1, "L": 150, "K": 40, "Hi": 3, "Di": 24})),
    timing_shape=Shape("timing", {"B": 1, "L": 1024, "K": 128, "Hi": 4, "Di": 32}),
    held_out=(Shape("held-odd", {"B": 1, "L": 211, "K": 33, "Hi": 2, "Di": 16, "docs": 3}),),
    held_out_timing=Shape("held-timing", {"B": 1, "L": 1400, "K": 160, "Hi": 4, "Di": 32}),
    tolerance=Tolerance(atol=2e-4, rtol=2e-3), space=SPACE, compare=compare,
    flops=lambda d: 3.0 * d["B"] * d["L"] * (d["L"] + 1) * d["Hi"] * d["Di"],
    bytes=lambda d: 4.0 * 2 * d["B"] * d["L"] * (d["Hi"] * d["Di"] + d["Di"] + d["Hi"]),
)  # fmt: skip
TASKS = (CPU,)
