"""`wanka bench moe`: the MoE layer (route, dispatch, experts, combine) forward+backward with
the grouped experts vs the per-expert loop, at 8, 64 and 256 experts, top-8 routing.

Both run side by side in one process on the same layer and input: each repeat times every
variant once, in turn (alternating, so load changes on a shared machine hit them alike), and the
median of the repeats is reported. The loop is the `grouped_swiglu` reference backend, forced
through the registry (WANKA_OPS_BACKEND); "grouped" is what the registry picks on this device;
every other backend that runs here (e.g. padded_bmm beside grouped_mm) is forced and timed as
an extra column. Each row runs at 1 torch thread (what a training rank uses: distributed/launch.py sets
OMP_NUM_THREADS=1) and at N (torch's default here). No shared experts (the same dense FFN in
every variant). Outputs and gradients of each variant
are checked against the loop's (max relative difference, recorded).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from wanka.bench.output import write_out
from wanka.config.schema import ModelConfig
from wanka.models.moe import MoE
from wanka.ops import registry

OP = "grouped_swiglu"
TOP_K = 8
EXPERTS = (8, 64, 256)
FULL = {"tokens": 4096, "dim": 512, "hidden": 256, "seqs": 4, "repeats": 5}
REL_TOL = 1e-4  # fp32: summation order differs, nothing else
QUICK = {"tokens": 1024, "dim": 256, "hidden": 128, "seqs": 2, "repeats": 3}


@contextmanager
def forced(backend: str | None):
    """Force `grouped_swiglu` to `backend` (None: the registry's own pick)."""
    old = os.environ.get(registry.ENV_OVERRIDE)
    others = [s for s in (old or "").split(",") if s.strip() and not s.strip().startswith(OP)]
    spec = ",".join(others + ([f"{OP}={backend}"] if backend else []))
    os.environ[registry.ENV_OVERRIDE] = spec
    try:
        yield
    finally:
        if old is None:
            del os.environ[registry.ENV_OVERRIDE]
        else:
            os.environ[registry.ENV_OVERRIDE] = old


def _layer(E: int, dim: int, hidden: int, seed: int = 0) -> MoE:
    cfg = ModelConfig(dim=dim, n_experts=E, n_active_experts=TOP_K, expert_hidden=hidden,
                      n_shared_experts=0)  # fmt: skip
    torch.manual_seed(seed)
    moe = MoE(cfg)
    for name, p in moe.named_parameters():
        torch.nn.init.normal_(p, std=0.02 if name.startswith("router") else dim**-0.5)
    return moe


def _step(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x.grad = None
    y, losses = moe(x)
    torch.autograd.backward([y, losses.balance], [g, torch.ones_like(losses.balance)])
    return [y.detach(), x.grad, *(p.grad for p in moe.parameters())]


def measure(E: int, tokens: int, dim: int, hidden: int, seqs: int, repeats: int) -> dict:
    """One row: median fwd+bwd ms of each variant, alternating, on one layer and input."""
    moe = _layer(E, dim, hidden)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seqs, tokens // seqs, dim, generator=gen).requires_grad_()
    g = torch.randn(x.shape, generator=gen)
    picked = registry.select(OP, x.device.type).name
    variants: dict[str, str | None] = {"loop": "reference", "grouped": None}
    for b in registry.backends(OP).values():
        runs_here = "*" in b.device_types or x.device.type in b.device_types
        if b.name not in ("reference", picked) and runs_here and b.available():
            variants[b.name] = b.name
    with torch.no_grad():
        idx, _, _ = moe.route(x.view(-1, dim))
        counts = torch.bincount(idx.flatten(), minlength=E)
    times: dict[str, list[float]] = {v: [] for v in variants}
    results: dict[str, list[torch.Tensor]] = {}
    for r in range(repeats + 1):  # the first round warms up
        for name, backend in variants.items():
            with forced(backend):
                t0 = time.perf_counter()
                out = _step(moe, x, g)
                dt = time.perf_counter() - t0
            if r == 0:
                results[name] = [t.clone() for t in out]
            else:
                times[name].append(dt)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    ref = results["loop"]
    row = {
        "experts": E, "top_k": TOP_K, "tokens": tokens, "seqs": seqs, "dim": dim,
        "hidden": hidden, "grouped_backend": picked, "repeats": repeats,
        "loop_ms": ms["loop"], "grouped_ms": ms["grouped"],
        "speedup": ms["loop"] / ms["grouped"],
        "max_over_mean_load": float(counts.max() / counts.float().mean()),
        "max_rel_diff": {  # vs the loop, over the output and every gradient
            name: max(_rel(a, b) for a, b in zip(res, ref))
            for name, res in results.items() if name != "loop"
        },
    }  # fmt: skip
    row["others_ms"] = {name: t for name, t in ms.items() if name not in ("loop", "grouped")}
    return row


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def markdown(rows: list[dict]) -> str:
    others = sorted({name for r in rows for name in r["others_ms"]})
    head = ["threads", "experts", "tokens", "dim", "hidden", "loop ms", "grouped ms", "speed-up"]
    head += [f"{name} ms" for name in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["threads"]), str(r["experts"]), str(r["tokens"]), str(r["dim"]), str(r["hidden"]),
                 f"{r['loop_ms']:.1f}", f"{r['grouped_ms']:.1f} ({r['grouped_backend']})",
                 f"{r['speedup']:.1f}x"]  # fmt: skip
        cells += [f"{r['others_ms'][n]:.1f}" if n in r["others_ms"] else "-" for n in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_moe_main(
    out: Path,
    quick: bool,
    *,
    experts: tuple[int, ...] = EXPERTS,
    shape: dict | None = None,
    threads: tuple[int, ...] | None = None,
) -> int:
    """Rows for each expert count x torch thread count (default 1 and N) -> JSON at `out`,
    Markdown table printed (and written next to it). Returns 1 when a grouped variant's result
    differs from the loop's beyond REL_TOL."""
    shape = shape or (QUICK if quick else FULL)
    n = torch.get_num_threads()
    threads = threads or ((1, n) if n > 1 else (1,))
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for E in experts:
                row = {"threads": t, **measure(E, **shape)}
                rows.append(row)
                print(f"threads={t} experts={E}: loop {row['loop_ms']:.1f} ms, grouped "
                      f"{row['grouped_ms']:.1f} ms ({row['grouped_backend']}), "
                      f"{row['speedup']:.2f}x", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(n)
    doc = {
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                    "torch_threads": torch.get_num_threads()},
        "torch": torch.__version__, "quick": quick, "shape": shape, "rows": rows,
    }  # fmt: skip
    write_out(out, json.dumps(doc, indent=2))
    table = markdown(rows)
    md = out.with_suffix(".md") if out.suffix != ".md" else out.with_suffix(".table.md")
    write_out(md, table + "\n")
    print(table)
    print(f"wrote {out} and {md}")
    bad = [r for r in rows if max(r["max_rel_diff"].values()) > REL_TOL]
    return 1 if bad else 0
