"""GPU benchmark of the attention operators' Triton backends (issue 3): time, memory, error,
TFLOP/s and the fraction of the device's measured bf16 matmul rate.

On a machine with a CUDA GPU, from the repository root (no install needed: this checkout's
src/ is put first on sys.path):

    bash benchmarks/gpu/run.sh --quick         # JSON, table and log to $OUT (or runs/bench/)
    python3 benchmarks/gpu/triton_ops.py       # full: L 4k..32k, k 512..2048
    python3 benchmarks/gpu/triton_ops.py --ops sparse_attention --lengths 32768 --topk 2048

Without a GPU, the smoke run (tiny shapes, the kernels in Triton's interpreter on CPU tensors;
its times are meaningless, its errors are not):

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu/triton_ops.py --smoke --device cpu

Measured, in this order: the bf16 (and TF32) dense matmul rate (n^3 products, CUDA events,
median of repeats); then per group (one op at one shape; every backend on the same inputs):
forward and forward+backward time (warm-up, then the median of repeats, CUDA events), peak
allocator memory above the inputs (reset_peak_memory_stats / max_memory_allocated), the
max abs error of the forward output and the max relative error of the gradients against the
reference run in float32 on the same inputs, achieved TFLOP/s from wanka.bench.ops.flops (the
CPU benchmark's model FLOPs) and its fraction of the measured bf16 rate. Ops and backends:
sparse_attention (triton, reference), dense_attention (triton, torch SDPA, reference),
lightning_indexer (triton, reference), indexer_kl (chunked, reference). When the reference's
estimated memory exceeds --ref-budget-gib it is not timed, and the error is taken on the last
--sample-rows query rows (forward only), which the row says. The Triton kernels upcast 16-bit
inputs to float32 and multiply in TF32, so the TF32 rate is their real ceiling: the JSON gives
the fraction of it too. The cpu backends of sparse attention and the indexer are not run on
GPU tensors (they allocate helper tensors on the CPU).

The JSON is rewritten after every group, so a run stopped by --budget-s (no new group starts
after it) or killed still leaves what it measured; the groups it did not start are listed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPS = ("sparse_attention", "dense_attention", "lightning_indexer", "indexer_kl")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Shapes per mode: the CPU benchmark's (wanka bench ops) lengths and top-k, tiny for --smoke.
MODES = {
    "full": dict(lengths=[4096, 8192, 16384, 32768], topk=[512, 1024, 2048], heads=16,
                 head_dim=64, index_heads=4, index_head_dim=32, warmup=2, repeats=10,
                 matmul_n=8192),
    "quick": dict(lengths=[4096, 8192], topk=[512, 1024], heads=16, head_dim=64,
                  index_heads=4, index_head_dim=32, warmup=2, repeats=10, matmul_n=8192),
    # smoke: 96 = one full and one partial 64-token tile; no warm-up (nothing compiles)
    "smoke": dict(lengths=[48, 96], topk=[16], heads=2, head_dim=16, index_heads=2,
                  index_head_dim=16, warmup=0, repeats=1, matmul_n=256),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="L 4k, 8k; k 512, 1024")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes (interpreter check)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu = Triton interpreter on CPU tensors (sets TRITON_INTERPRET=1)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="input dtype; auto = bf16 on cuda, fp32 on cpu (the interpreter)",
    )
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--lengths", nargs="+", type=int, help="override the mode's L values")
    p.add_argument("--topk", nargs="+", type=int, help="override the mode's k values")
    p.add_argument(
        "--patterns", nargs="+", choices=("realistic", "random"), default=["realistic", "random"]
    )
    p.add_argument("--heads", type=int, help="attention query heads H")
    p.add_argument("--head-dim", type=int, help="attention head dim D (64 or 128)")
    p.add_argument("--index-heads", type=int, help="indexer heads Hi")
    p.add_argument("--index-head-dim", type=int, help="indexer head dim Di")
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--matmul-n", type=int, help="size of the matmul-rate products")
    p.add_argument(
        "--ref-budget-gib",
        type=float,
        default=40.0,
        help="largest estimated reference memory to run it (timing and fp32 error)",
    )
    p.add_argument(
        "--sample-rows",
        type=int,
        default=256,
        help="query rows checked when the full reference is over the budget",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="no new group starts after this many seconds (the JSON keeps the rest)",
    )
    p.add_argument("--out", type=Path, help="JSON path (default $OUT/triton_ops.json if OUT "
                   "is set, else runs/bench/gpu-triton-ops.json); the table goes beside it")  # fmt: skip
    args = p.parse_args(argv)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    for key, value in MODES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.out is None:
        out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "bench"
        args.out = out_dir / ("triton_ops.json" if os.environ.get("OUT") else "gpu-triton-ops.json")
    return args


def prepare(device: str) -> str | None:
    """Set up what must come before torch / triton are imported, then import them; return a
    message naming everything that is missing, or None."""
    # This checkout's kernels, whether or not (or wherever else) wanka is installed.
    sys.path.insert(0, str(REPO / "src"))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device == "cpu" and not interpreted:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton reads it once, when first imported
    if device == "cuda" and interpreted:
        return ("TRITON_INTERPRET=1 is set, so the kernels would run in Triton's interpreter: "
                "unset it to time them on the GPU (or pass --device cpu for the smoke run)")  # fmt: skip
    try:
        import torch
    except ImportError as e:
        return (f"torch is not importable by {sys.executable} ({e}); run with the python that "
                "has torch (run.sh takes it from $PYTHON, default python3)")  # fmt: skip
    missing = []
    try:
        import triton  # noqa: F401
    except ImportError as e:
        missing.append(f"triton is not importable ({e}): the Triton backends cannot run")
    if device == "cuda" and not torch.cuda.is_available():
        missing.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    try:
        import wanka.ops  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure is reported, not raised)
        missing.append(f"wanka is not importable from {REPO / 'src'}: {type(e).__name__}: {e}")
    return "; ".join(missing) or None


def environment(device, dtype) -> dict:
    """Machine, versions and settings recorded with the results."""
    import torch
    import triton

    import wanka

    info: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "wanka_from": str(Path(wanka.__file__).parent),
        "git_commit": _git_commit(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "dtype": str(dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                          "sm_count": p.multi_processor_count,
                          "memory_gib": round(p.total_memory / 2**30, 1)}  # fmt: skip
    else:
        info["device"] = {"name": f"cpu ({platform.machine()})", "cpu_count": os.cpu_count()}
    return info


def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                           capture_output=True, text=True, timeout=10)  # fmt: skip
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None  # the GPU machine's copy of the tree may have no .git


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    problem = prepare(args.device)
    if problem:
        print(f"cannot run the GPU operator benchmark: {problem}", file=sys.stderr)
        return 2
    import measure as m  # after prepare(): TRITON_INTERPRET and sys.path are set
    import torch

    device = torch.device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    timer = m.Timer(device, args.warmup, args.repeats)
    doc = {
        "benchmark": "benchmarks/gpu/triton_ops.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": args.mode,
        "argv": sys.argv[1:] if argv is None else argv,
        **environment(device, dtype),
        "timing_valid": device.type == "cuda",
        "shapes": {
            "B": 1,
            "H": args.heads,
            "D": args.head_dim,
            "Hi": args.index_heads,
            "Di": args.index_head_dim,
            "lengths": args.lengths,
            "topk": args.topk,
            "patterns": args.patterns,
        },  # fmt: skip
        "timing": {
            "warmup": args.warmup,
            "repeats": args.repeats,
            "statistic": "median",
            "clock": "cuda events" if device.type == "cuda" else "perf_counter",
        },  # fmt: skip
        "ref_budget_gib": args.ref_budget_gib,
        "budget_s": args.budget_s,
    }
    if not doc["timing_valid"]:
        doc["note"] = ("Triton interpreter on CPU tensors: times, TFLOP/s and fractions of "
                       "the matmul rate are meaningless; the errors are valid")  # fmt: skip
        print(f"NOTE: {doc['note']}", flush=True)
    print(f"device {doc['device']['name']}, torch {doc['torch']}, triton {doc['triton']}, "
          f"inputs {doc['dtype']}, wanka from {doc['wanka_from']}", flush=True)  # fmt: skip

    doc["matmul_peak"] = m.matmul_peak(timer, torch.bfloat16, args.matmul_n)
    doc["matmul_peak_tf32"] = m.matmul_peak(timer, torch.float32, args.matmul_n, tf32=True)
    for key in ("matmul_peak", "matmul_peak_tf32"):
        pk = doc[key]
        print(f"matmul {pk['dtype']} {pk['n']}^3: {pk['tflops']:.1f} TFLOP/s", flush=True)
    cfg = m.Settings(args.ref_budget_gib, args.sample_rows, doc["matmul_peak"]["tflops"],
                     doc["matmul_peak_tf32"]["tflops"])  # fmt: skip

    groups = m.make_groups(args.ops, args.lengths, args.topk, args.patterns, args.heads,
                           args.head_dim, args.index_heads, args.index_head_dim)  # fmt: skip
    doc["planned"] = [g.name for g in groups]
    doc["cases"], doc["not_run"], doc["complete"] = [], [], False
    write_json(args.out, doc)  # device, versions and matmul rate survive even a crash
    status = 0
    for i, g in enumerate(groups):
        elapsed = time.monotonic() - t_start
        if elapsed > args.budget_s:
            doc["not_run"] = [x.name for x in groups[i:]]
            print(f"time budget: {elapsed:.0f} s > {args.budget_s:g} s, "
                  f"{len(groups) - i} groups not started", flush=True)  # fmt: skip
            break
        try:
            rows = m.run_group(g, device, dtype, timer, cfg)
        except m.DeviceBroken as e:
            doc["fatal"] = f"{g.name}: {e}"
            doc["not_run"] = [x.name for x in groups[i:]]
            print(f"FATAL (CUDA context lost, stopping): {doc['fatal']}", flush=True)
            status = 3
            break
        doc["cases"] += rows
        status = max(status, int(any("error" in r for r in rows)))
        for r in rows:
            print(format_row(r), flush=True)
        doc["wall_s"] = time.monotonic() - t_start
        write_json(args.out, doc)
    else:
        doc["complete"] = True
    doc["wall_s"] = time.monotonic() - t_start
    write_json(args.out, doc)
    table = markdown(doc)
    args.out.with_suffix(".md").write_text(table)
    print("\n" + table)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} ({doc['wall_s']:.0f} s)")
    return status


# ---------------------------------------------------------------------------------------------
# Output


def write_json(path: Path, doc: dict) -> None:
    """Strict JSON (non-finite floats as strings), replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=2))
    tmp.replace(path)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def format_row(r: dict) -> str:
    """One progress line per backend row (label as in `wanka bench ops`)."""
    from wanka.bench.ops import row_head, unmeasured

    if why := unmeasured(r):
        return f"{row_head(r)} {why}"
    peak = "-" if r["peak_fwd_bwd_mib"] is None else f"{r['peak_fwd_bwd_mib']:.0f}"
    return (f"{row_head(r)} fwd {r['fwd_ms']:9.3f} ms  fwd+bwd "
            f"{r['fwd_bwd_ms']:9.3f} ms  peak {peak:>7s} MiB  {r['tflops_fwd_bwd']:7.2f} "
            f"TFLOP/s ({r['frac_bf16_peak_fwd_bwd']:.1%} of bf16)  err {_err_cell(r)}")  # fmt: skip


def _err_cell(r: dict) -> str:
    if "max_abs_err" not in r:
        return "-"
    cell = _num(r["max_abs_err"]) + ("*" if r["err_scope"].startswith("last") else "")
    if "index_agreement" in r:
        cell += f", sel {r['index_agreement']:.2%}"
    return cell


def _num(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) and math.isfinite(x) else str(x)


def markdown(doc: dict) -> str:
    """The table for docs/BENCHMARKS.md, with the lines that say what it is above it."""
    dev, sh, tm = doc["device"], doc["shapes"], doc["timing"]
    mp, mt = doc["matmul_peak"], doc["matmul_peak_tf32"]
    gpu = (f"{dev['name']} (sm {dev['capability']}, {dev['sm_count']} SMs, "
           f"{dev['memory_gib']} GiB)" if "capability" in dev else dev["name"])  # fmt: skip
    lines = [
        f"`{' '.join(['benchmarks/gpu/triton_ops.py', *doc['argv']])}`",
        f"({doc['date']}, commit {doc['git_commit'] or 'unknown'}). {gpu}, torch {doc['torch']}"
        f" (CUDA {doc['torch_cuda']}), triton {doc['triton']}. Inputs {doc['dtype']}, B = 1, "
        f"H = {sh['H']} x D = {sh['D']} attention (one KV head), indexer {sh['Hi']} x "
        f"{sh['Di']}, one document; median of {tm['repeats']} after {tm['warmup']} warm-up(s) "
        f"({tm['clock']}). Measured matmul rate ({mp['n']}^3): {mp['dtype']} "
        f"{mp['tflops']:.1f} TFLOP/s, {mt['dtype']} {mt['tflops']:.1f} TFLOP/s. TFLOP/s = "
        "model FLOPs of forward+backward (`wanka.bench.ops.flops`) / time; % = of the bf16 "
        "rate. Peak = allocator peak above the inputs during forward+backward. Errors vs the "
        "reference in float32 on the same inputs: max abs error of the output (* = on the "
        "last query rows only, the full reference being over the memory budget; sel = share "
        "of the reference's top-k selected), max relative error of the input gradients.",
    ]
    if doc.get("note"):
        lines.append(f"\n**{doc['note']}.**")
    lines += [
        "",
        "| op | L | k | indices / shape | backend | fwd (ms) | fwd+bwd (ms) | vs reference "
        "| peak MiB | TFLOP/s | % of bf16 peak | max abs err | grad rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref_ms = {r["group"]: r.get("fwd_bwd_ms") for r in doc["cases"] if r["backend"] == "reference"}
    for r in doc["cases"]:
        head = f"| {r['op']} | {r['L']} | {r['k'] or '-'} | {_shape(r)} | {r['backend']} |"
        if "skipped" in r or "error" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR: {r['error']}"
            lines.append(f"{head} {what} | | | | | | | |")
            continue
        ref = ref_ms.get(r["group"])
        speed = f"{ref / r['fwd_bwd_ms']:.1f}x" if ref and r["backend"] != "reference" else ""
        peak = "n/a" if r["peak_fwd_bwd_mib"] is None else f"{r['peak_fwd_bwd_mib']:.0f}"
        grad = _num(r["max_rel_err_grad"]) if "max_rel_err_grad" in r else "-"
        lines.append(
            f"{head} {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {speed} | {peak} | "
            f"{r['tflops_fwd_bwd']:.2f} | {r['frac_bf16_peak_fwd_bwd']:.1%} | {_err_cell(r)} | "
            f"{grad} |"
        )
    if doc["not_run"]:
        lines.append(f"\nNot started (time budget or a fatal error): {'; '.join(doc['not_run'])}.")
    return "\n".join(lines) + "\n"


def _shape(r: dict) -> str:
    if r["op"] == "sparse_attention":
        return r["pattern"]
    if r["op"] == "dense_attention":
        return "causal"
    return f"{r['Hi']} x {r['Di']}"


if __name__ == "__main__":
    sys.exit(main())
