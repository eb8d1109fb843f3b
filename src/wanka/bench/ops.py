"""`wanka bench ops`: attention operators per backend, each case in a fresh subprocess.

Per case: forward and forward+backward time (median of repeats after warm-up), peak memory
(process max-RSS growth over the case on CPU; allocator peak on accelerators), max error vs the
reference on the same inputs, and achieved FLOP/s against a measured matmul peak. A fresh
process per case keeps one case's peak memory from hiding another's. Cases whose estimated
memory exceeds the budget are recorded as skipped with the estimate, never silently dropped.

Every case runs at 1 torch thread and at N (torch's default here), each in its own process,
and the table puts them side by side: training runs one thread per rank, a single-rank user
and the lab run N. Sparse attention index patterns: `realistic`, `random`, `block` (local
window + scattered 64-key blocks) and `packed` (realistic over 8 packed documents); see
wanka.ops.index_patterns.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

GIB = 1024**3


PATTERNS = ("realistic", "random", "block", "packed")
PACKED_DOCS = 8  # documents per row of the `packed` pattern
PATTERN_K = 1024  # block and packed run at this k only (realistic and random at every k)


def default_threads() -> tuple[int, ...]:
    """(1, N): N = torch's default thread count in a fresh process here."""
    import torch

    n = torch.get_num_threads()
    return (1, n) if n > 1 else (1,)


def _cases(quick: bool) -> list[dict]:
    """Shapes of the issue: L in 4k..32k, k in 512..2048; quick keeps L = 4096 at k = 1024
    (every index pattern, both backends: 12 cases), so it ends in minutes on 2 cores."""
    H, D = 16, 64
    Ls = [4096] if quick else [4096, 8192, 16384, 32768]
    ks = [PATTERN_K] if quick else [512, 1024, 2048]
    cases = []
    for L in Ls:
        for k in ks:
            for pattern in PATTERNS if k == PATTERN_K else PATTERNS[:2]:
                for backend in ("reference", "cpu"):
                    cases.append(
                        dict(
                            op="sparse_attention",
                            backend=backend,
                            L=L,
                            k=k,
                            H=H,
                            D=D,
                            pattern=pattern,
                        )
                    )
        for backend in ("reference", "cpu"):
            cases.append(dict(op="dense_attention", backend=backend, L=L, H=H, D=D))
            for k in ks:
                cases.append(dict(op="lightning_indexer", backend=backend, L=L, k=k, Hi=4, Di=32))
    return cases


def estimate_bytes(case: dict) -> float:
    """Rough peak of the materialising reference (the fast backends stay far below it)."""
    L, B = case["L"], 1
    if case["backend"] != "reference":
        return 0.0
    if case["op"] == "sparse_attention":  # gathered K, V and their grads, scores/probs
        return B * L * case["k"] * (4 * case["D"] + 3 * case["H"]) * 4
    if case["op"] == "dense_attention":
        return B * case["H"] * L * L * 4 * 4
    if case["op"] == "indexer_kl":  # [L, H, L] target logits/probs, [L, Hi, L] scores + grads
        return B * L * L * (3 * case["H"] + 3 * case["Hi"] + 6) * 4
    return B * L * L * (case["Hi"] * 2 + 4) * 4  # indexer: [L, Hi, L] relu scores + grads


def flops(case: dict) -> tuple[float, float]:
    """(forward, forward+backward) model FLOPs of the op (matmul work only)."""
    L = case["L"]
    if case["op"] == "sparse_attention":
        f = 4 * L * case["k"] * case["H"] * case["D"]
    elif case["op"] == "dense_attention":
        f = 4 * L * (L + 1) / 2 * case["H"] * case["D"]
    elif case["op"] == "indexer_kl":
        # Forward: the target's q.k logits (every head, visible key) and the indexer's scores;
        # the gradients add the indexer's dq and dk products (the target gets none).
        pairs = L * (L + 1) / 2
        f = 2 * pairs * (case["H"] * case["D"] + case["Hi"] * case["Di"])
        return f, f + 2 * 2 * pairs * case["Hi"] * case["Di"]
    else:
        f = 2 * L * (L + 1) / 2 * case["Hi"] * case["Di"]
    return f, 3.5 * f  # backward ~2.5x forward for attention (recompute of scores included)


CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_window() -> Callable[[], float]:
    """Start measuring peak memory; returns a function giving the peak RSS growth in MiB since.

    On Linux, writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS, so building
    the inputs and indices beforehand does not hide the op's own peak. Where that is refused or
    does nothing (a read-only /proc, sandboxed kernels), the process's max RSS only moves once
    the op beats every earlier peak of the process, so a thread also samples the RSS every
    millisecond: the answer is the larger of the two (the sampled one may miss a peak shorter
    than a millisecond, never invents one)."""
    try:
        base = _status_kib("VmRSS")
        CLEAR_REFS.write_text("5")
        if _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024:  # the reset took
            base = _status_kib("VmRSS")
            return lambda: max(0, _status_kib("VmHWM") - base) / 1024
    except OSError:
        pass
    return _SampledPeak()


class _SampledPeak:
    """Peak RSS growth from the process's max RSS where it moved, else from 1 ms samples."""

    def __init__(self) -> None:
        import resource
        import threading
        import weakref

        self._resource = resource
        self._start_max = self._max_rss_kib()
        try:
            self._base = _status_kib("VmRSS")
        except OSError:  # no /proc (other systems): only the max RSS counter
            self._base = self._start_max
        self._sampled = [self._base]
        stop = threading.Event()
        if Path("/proc/self/status").exists():
            threading.Thread(target=_sample_rss, args=(self._sampled, stop), daemon=True).start()
        weakref.finalize(self, stop.set)

    def _max_rss_kib(self) -> int:
        return self._resource.getrusage(self._resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def __call__(self) -> float:
        peak = self._sampled[0]
        try:
            peak = max(peak, _status_kib("VmRSS"))  # now, too: the sampler may not have run yet
        except OSError:
            pass
        now_max = self._max_rss_kib()
        if now_max > self._start_max:  # a new peak of the process: it came inside the window
            peak = max(peak, now_max)
        return max(0, peak - self._base) / 1024


def _sample_rss(sampled: list[int], stop) -> None:
    while not stop.wait(0.001):
        try:
            sampled[0] = max(sampled[0], _status_kib("VmRSS"))
        except OSError:
            return


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def sparse_indices(pattern: str, L: int, k: int, seed: int = 1):
    """[1, L, k] indices of a bench pattern (see PATTERNS)."""
    from wanka.ops import index_patterns as ip

    if pattern == "realistic":
        return ip.realistic_indices(1, L, k, seed=seed)
    if pattern == "random":
        return ip.random_indices(1, L, k, seed=seed)
    if pattern == "block":
        return ip.block_sparse_indices(1, L, k, seed=seed)
    if pattern == "packed":
        docs = ip.packed_doc_ids(1, L, PACKED_DOCS, seed=seed)
        return ip.realistic_indices(1, L, k, seed=seed, doc_ids=docs)
    raise ValueError(f"unknown index pattern {pattern!r}; one of {PATTERNS}")


def run_case(case: dict, repeats: int) -> dict:
    """Executed inside the child process."""
    import torch

    from wanka import ops
    from wanka.bench.longctx import median_time

    if case.get("threads"):
        torch.set_num_threads(int(case["threads"]))
    torch.manual_seed(0)
    os.environ["WANKA_OPS_BACKEND"] = f"{case['op']}={case['backend']}"
    L = case["L"]
    doc_ids = torch.zeros(1, L, dtype=torch.int32)
    if case["op"] == "sparse_attention":
        q, k, v = (
            torch.randn(1, L, case["H"], case["D"]),
            torch.randn(1, L, case["D"]),
            torch.randn(1, L, case["D"]),
        )
        idx = sparse_indices(case["pattern"], L, case["k"])
        inputs, fn = (
            (q, k, v),
            lambda q, k, v: ops.call("sparse_attention", q, k, v, idx, case["D"] ** -0.5),
        )
    elif case["op"] == "dense_attention":
        q, k, v = (
            torch.randn(1, L, case["H"], case["D"]),
            torch.randn(1, L, case["D"]),
            torch.randn(1, L, case["D"]),
        )
        inputs, fn = (
            (q, k, v),
            lambda q, k, v: ops.call("dense_attention", q, k, v, doc_ids, case["D"] ** -0.5),
        )
    else:
        q, k, w = (
            torch.randn(1, L, case["Hi"], case["Di"]),
            torch.randn(1, L, case["Di"]),
            torch.randn(1, L, case["Hi"]),
        )
        inputs = (q, k, w)

        def fn(q, k, w):
            return ops.call("lightning_indexer", q, k, w, doc_ids, case["k"])[1]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    leaves = [t.clone().requires_grad_(True) for t in inputs]

    def fwd_bwd():
        out = fn(*leaves)
        out = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
        out.sum().backward()

    result = {"fwd_s": median_time(fwd, repeats), "fwd_bwd_s": median_time(fwd_bwd, repeats)}
    # The peak of one more forward + backward, after the timings: the window may sample the
    # RSS from a thread (peak_rss_window), which must not run beside the timed calls.
    for t in leaves:
        t.grad = None  # the gradients' own memory counts, as on a first call
    peak_mb = peak_rss_window()
    fwd_bwd()
    result["peak_mb"] = peak_mb()
    del peak_mb  # ends a sampling thread
    # Error vs the reference on the same inputs (forward), in this process.
    with torch.no_grad():
        mine = fn(*inputs)
        os.environ["WANKA_OPS_BACKEND"] = f"{case['op']}=reference"
        if (
            case["backend"] != "reference"
            and estimate_bytes({**case, "backend": "reference"}) < 6 * GIB
        ):
            ref = fn(*inputs)
            both = torch.isfinite(ref) & torch.isfinite(mine)
            if not torch.equal(torch.isfinite(ref), torch.isfinite(mine)):
                result["max_abs_err"] = float("inf")  # NaN / inf where the other is finite
            else:
                result["max_abs_err"] = float((mine - ref)[both].abs().max()) if both.any() else 0.0
    f, fb = flops(case)
    result["fwd_gflops"] = f / result["fwd_s"] / 1e9
    result["fwd_bwd_gflops"] = fb / result["fwd_bwd_s"] / 1e9
    return result


def bench_ops_main(
    quick: bool,
    out: Path,
    budget_gib: float = 12.0,
    repeats: int | None = None,
    threads: tuple[int, ...] | None = None,
) -> int:
    """Every case at each torch thread count in `threads` (default 1 and N, see
    default_threads), each in a fresh process."""
    from wanka.bench.flops import measure_matmul_peak
    from wanka.bench.ops_table import markdown_table

    repeats = repeats or (2 if quick else 3)
    threads = tuple(threads or default_threads())
    peak = measure_matmul_peak()
    rows, failed = [], 0
    for case in (
        {**base, "threads": n} for base in _cases(quick) for n in threads
    ):  # each shape at every thread count, side by side
        row = dict(case)
        est = estimate_bytes(case)
        if est > budget_gib * GIB:
            row["skipped"] = f"estimated {est / GIB:.1f} GiB > budget {budget_gib} GiB"
        else:
            row.update(_run_child(case, repeats, peak))
            failed += "error" in row
        rows.append(row)
        print(_fmt(row), flush=True)
    longctx = _long_context(quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": {"nproc": os.cpu_count(), "platform": platform.platform()},
            "torch": __import__("torch").__version__, "matmul_peak_flops": peak, "quick": quick,
            "threads": list(threads)}  # fmt: skip
    doc = {**meta, "cases": rows, **longctx}
    out.write_text(json.dumps(doc, indent=2))
    table = out.with_suffix(".md") if out.suffix != ".md" else out.with_suffix(".table.md")
    table.write_text(markdown_table(doc) + "\n")
    print(f"wrote {out} and {table}")
    return 1 if failed else 0


def _run_child(case: dict, repeats: int, peak: float) -> dict:
    """One case in a fresh process -> its figures, or {"error": ...}."""
    cmd = [sys.executable, "-m", "wanka.bench.ops", json.dumps(case), str(repeats)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["fraction_of_peak"] = res["fwd_bwd_gflops"] * 1e9 / peak
    if res.get("max_abs_err") == float("inf"):  # also keeps the JSON strict
        del res["max_abs_err"]
        res["error"] = "non-finite output where the reference is finite"
    return res


def _long_context(quick: bool) -> dict:
    """Sparse-vs-dense crossover per k, and the model step with index_share_every = 1, 2, 4."""
    import dataclasses

    from wanka.bench.longctx import crossover, model_step_times
    from wanka.models.flavors import FLAVORS

    lengths = [1024, 2048, 4096] + ([] if quick else [8192, 16384])
    cross = [crossover(k, lengths) for k in (1024, 2048)]
    for c in cross:
        cells = "  ".join(f"L={r['L']}: {r['sparse_s']:.2f}/{r['dense_s']:.2f}s" for r in c["rows"])
        won = (f"sparse wins from L={c['crossover_L']}" if c["crossover_L"]
               else f"sparse does not win up to L={lengths[-1]}")  # fmt: skip
        print(f"crossover k={c['k']}: sparse/dense fwd+bwd {cells} -> {won}")
    # `tiny` widened to a realistic indexer (4 heads x 32) with k = 512, 4 layers, so that a
    # 2-core CPU runs 8k-16k-token steps in seconds.
    base = dataclasses.replace(FLAVORS["tiny"], n_layers=4, index_topk=512, n_index_heads=4,
                               index_head_dim=32, max_seq_len=32768)  # fmt: skip
    model = model_step_times(base, [4096] if quick else [8192, 16384], [1, 2, 4])
    for r in model:
        print(
            f"model L={r['L']} share={r['index_share_every']}: step {r['step_s']:.2f} s, "
            f"indexer {r['indexer_s']:.2f} s ({r['indexer_share']:.0%}, {r['indexer_layers']} layers)"
        )
    return {"crossover": cross, "model_long_context": model,
            "model_long_context_config": dataclasses.asdict(base)}  # fmt: skip


def row_head(r: dict) -> str:
    """The label each table row starts with: op, backend, L, k, index pattern (and torch
    threads when the row records them)."""
    k = r.get("k") or "-"
    t = f" t={r['threads']}" if r.get("threads") else ""
    return (f"{r['op']:17s} {r['backend']:9s} L={r['L']:<6d} k={k!s:5s} "
            f"{r.get('pattern') or '':9s}{t}")  # fmt: skip


def unmeasured(r: dict) -> str | None:
    """Why a row has no figures (skipped, or the case failed), None when it has them."""
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "error" in r:
        return f"ERROR {r['error']}"
    return None


def _fmt(r: dict) -> str:
    if why := unmeasured(r):
        return f"{row_head(r)} {why}"
    err = f" err {r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
    return (f"{row_head(r)} fwd {r['fwd_s'] * 1e3:9.1f} ms  fwd+bwd {r['fwd_bwd_s'] * 1e3:9.1f} ms  "
            f"peak {r['peak_mb']:8.0f} MB  {r['fwd_bwd_gflops']:6.1f} GFLOP/s{err}")  # fmt: skip


if __name__ == "__main__":  # one case, in a fresh process
    print(json.dumps(run_case(json.loads(sys.argv[1]), int(sys.argv[2]))))
