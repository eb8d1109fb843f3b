"""CPU benchmark: dense_attention, lightning_indexer and the dense warm-up indexer KL
(indexer_kl), reference vs CPU / chunked backends.

Each case runs in a fresh subprocess: inputs are built, then 1 warm-up + `--repeats` timed
runs; reported are the median time and the peak RSS growth over the RSS after input creation
(ru_maxrss, so it includes autograd's saved tensors and backward temporaries).

    python benchmarks/indexer_dense_cpu.py                 # all default cases
    python benchmarks/indexer_dense_cpu.py --only dense    # or: --only indexer, --only kl
    python benchmarks/indexer_dense_cpu.py --big-indexer   # adds 64 heads x 128 (slow)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_case(case: dict) -> dict:
    import torch

    from wanka.ops.dense_attention import cpu as dense_cpu
    from wanka.ops.dense_attention import reference as dense_ref
    from wanka.ops.indexer_kl import chunked as kl_chunked
    from wanka.ops.indexer_kl import reference as kl_ref
    from wanka.ops.lightning_indexer import cpu as idx_cpu
    from wanka.ops.lightning_indexer import reference as idx_ref

    torch.manual_seed(0)
    B, L, n_docs = 1, case["L"], case["docs"]
    doc = torch.repeat_interleave(torch.arange(n_docs), L // n_docs)[None].expand(B, L)
    doc = doc.contiguous()
    bwd = case["mode"] == "fwd+bwd"
    if case["op"] == "dense":
        H, D = case["H"], case["D"]
        q = torch.randn(B, L, H, D, requires_grad=bwd)
        k = torch.randn(B, L, D, requires_grad=bwd)
        v = torch.randn(B, L, D, requires_grad=bwd)
        fn = dense_ref.dense_attention if case["impl"] == "reference" else dense_cpu.dense_attention

        def step():
            out = fn(q, k, v, doc, D**-0.5)
            if bwd:
                out.sum().backward()
    elif case["op"] == "kl":  # attention H x D (target, no grad), indexer 4 x 32
        H, D, Hi, Di = case["H"], case["D"], 4, 32
        q, k = torch.randn(B, L, H, D), torch.randn(B, L, D)
        qi = torch.randn(B, L, Hi, Di, requires_grad=bwd)
        ki = torch.randn(B, L, Di, requires_grad=bwd)
        wi = torch.randn(B, L, Hi, requires_grad=bwd)
        fn = kl_ref.indexer_kl if case["impl"] == "reference" else kl_chunked.indexer_kl

        def step():
            with torch.set_grad_enabled(bwd):
                kl = fn(q, k, qi, ki, wi, doc, D**-0.5)
                if bwd:
                    kl.backward()
    else:
        Hi, Di, K = case["H"], case["D"], case["topk"]
        q = torch.randn(B, L, Hi, Di, requires_grad=bwd)
        k = torch.randn(B, L, Di, requires_grad=bwd)
        w = torch.randn(B, L, Hi, requires_grad=bwd)
        fn = idx_ref.lightning_indexer if case["impl"] == "reference" else idx_cpu.lightning_indexer

        def step():
            with torch.set_grad_enabled(bwd):
                idx, val = fn(q, k, w, doc, K)
                if bwd:
                    val.masked_fill(idx < 0, 0).sum().backward()

    base = _rss_mib()
    times = []
    for i in range(1 + case["repeats"]):
        t = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t)
    return {**case, "median_s": statistics.median(times), "peak_rss_growth_mib": _rss_mib() - base}


def cases(only: str | None, big_indexer: bool, repeats: int) -> list[dict]:
    out = []
    if only in (None, "dense"):
        for H, D in [(16, 64), (4, 32)]:
            for docs in (1, 4):
                for impl in ("reference", "cpu"):
                    out.append(dict(op="dense", impl=impl, L=4096, H=H, D=D, docs=docs,
                                    mode="fwd+bwd", repeats=repeats))  # fmt: skip
    if only in (None, "indexer"):
        for topk in (1024, 2048):
            for mode in ("fwd", "fwd+bwd"):
                for impl in ("reference", "cpu"):
                    out.append(dict(op="indexer", impl=impl, L=8192, H=4, D=32, topk=topk,
                                    docs=1, mode=mode, repeats=repeats))  # fmt: skip
        if big_indexer:  # the reference would need a 16 GiB [L, 64, L] tensor: ours only
            for mode in ("fwd", "fwd+bwd"):
                out.append(dict(op="indexer", impl="cpu", L=8192, H=64, D=128,
                                topk=2048, docs=1, mode=mode, repeats=1))  # fmt: skip
    if only in (None, "kl"):
        for L in (2048, 4096):
            for impl in ("reference", "chunked"):
                out.append(dict(op="kl", impl=impl, L=L, H=16, D=64, docs=1,
                                mode="fwd+bwd", repeats=repeats))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["dense", "indexer", "kl"])
    ap.add_argument("--big-indexer", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    a = ap.parse_args()
    if a.case:
        print(json.dumps(run_case(json.loads(a.case))))
        return
    rows = []
    for c in cases(a.only, a.big_indexer, a.repeats):
        p = subprocess.run([sys.executable, __file__, "--case", json.dumps(c)],
                           capture_output=True, text=True)  # fmt: skip
        if p.returncode != 0:
            print(f"FAILED {c}: {p.stderr[-2000:]}", file=sys.stderr)
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(json.dumps(r), flush=True)
    print("\n| op | impl | L | heads x dim | topk | docs | mode | median s | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['impl']} | {r['L']} | {r['H']}x{r['D']} | {r.get('topk', '-')} "
              f"| {r['docs']} | {r['mode']} | {r['median_s']:.3f} | {r['peak_rss_growth_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
