"""Sparse-attention CPU backend vs the reference: time and peak memory, forward and fwd+bwd.

Each case runs in a fresh subprocess (so peak RSS is its own): the child loads cached q/k/v
shapes' indices from disk (generating them would raise the peak before the baseline), records
ru_maxrss, runs one warm-up fwd+bwd, then `--repeats` forward passes and fwd+bwd passes, and
reports medians and the peak-RSS growth over the baseline (inputs and indices excluded).

    .venv/bin/python benchmarks/sparse_attention_cpu.py                  # the default table
    .venv/bin/python benchmarks/sparse_attention_cpu.py --L 8192 32768 --impls cpu
    .venv/bin/python benchmarks/sparse_attention_cpu.py --threads 1
    .venv/bin/python benchmarks/sparse_attention_cpu.py --growth --L 8192 32768
    .venv/bin/python benchmarks/sparse_attention_cpu.py --thread-counts 1,2 --L 8192 --compete 1

`--growth` measures how fwd+bwd time grows with L at fixed K, side by side in one process:
runs at the short and long length alternate (short, long, short, ...) and each long run is
divided by the mean of the short runs on either side, so drifts in the machine's load hit
both; it prints the median and range of those ratios and the ratio of work (valid selected
(query, key) pairs: causal queries before position K select fewer than K keys).

`--thread-counts 1,2` measures the speed-up over the reference at each torch thread count,
side by side in one process: each round runs reference then cpu fwd+bwd at 1 thread, then
both at 2 threads, and so on, so a change in the machine's load hits every cell of a round;
it prints per thread count the median time of each and the median (and range) of the
per-round speed-ups. `--compete N` keeps N other processes busy (a pure-Python spin each, in
its own session) during the measurement: a machine with other load, where OpenMP teams lose
their threads.

Indices: `random` = wanka.ops.index_patterns.random_indices (uniform), `realistic` =
realistic_indices (3K/4 local window + K/8 shared heavy hitters + ~K/8 random; see there),
`block` = block_sparse_indices (K/4 window + 64-key blocks), `packed` = realistic over 8
packed documents (packed_doc_ids).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CACHE = Path(tempfile.gettempdir()) / "wanka_sparse_attention_bench"


def _indices_path(pattern: str, L: int, K: int) -> Path:
    return CACHE / f"{pattern}_L{L}_K{K}.pt"


def _ensure_indices(pattern: str, L: int, K: int) -> Path:
    from wanka.bench.ops import sparse_indices

    path = _indices_path(pattern, L, K)
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        torch.save(sparse_indices(pattern, L, K, seed=0), path)
        print(f"# generated {path.name} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return path


def _child(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    from wanka.ops.sparse_attention import cpu, reference

    fn = {"reference": reference.sparse_attention, "cpu": cpu.sparse_attention}[args.impl]
    idx = torch.load(_indices_path(args.pattern, args.L, args.K))
    g = torch.Generator().manual_seed(0)
    B, L, H, D = 1, args.L, args.H, args.D
    q = torch.randn(B, L, H, D, generator=g).requires_grad_()
    k = torch.randn(B, L, D, generator=g).requires_grad_()
    v = torch.randn(B, L, D, generator=g).requires_grad_()
    dout = torch.randn(B, L, H, D, generator=g)
    scale = D**-0.5
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def fwd():
        return fn(q, k, v, idx, scale)

    def fwd_bwd():
        torch.autograd.grad(fn(q, k, v, idx, scale), (q, k, v), dout)

    fwd_bwd()  # warm-up
    times = {"fwd": [], "fwd_bwd": [], "fwd_cpu": [], "fwd_bwd_cpu": []}
    for _ in range(args.repeats):
        for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            t, c = time.perf_counter(), time.process_time()
            out = f()
            times[name].append(time.perf_counter() - t)
            times[name + "_cpu"].append(time.process_time() - c)
            del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "fwd_s": statistics.median(times["fwd"]),
        "fwd_bwd_s": statistics.median(times["fwd_bwd"]),
        "fwd_cpu_s": statistics.median(times["fwd_cpu"]),
        "fwd_bwd_cpu_s": statistics.median(times["fwd_bwd_cpu"]),
        "peak_mib": (peak - base) / 1024,
        "threads": torch.get_num_threads(),
    }))  # fmt: skip


def _run_case(impl, pattern, L, K, H, D, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--impl", impl, "--pattern", pattern,
           "--L", str(L), "--K", str(K), "--H", str(H), "--D", str(D),
           "--repeats", str(args.repeats), "--threads", str(args.threads)]  # fmt: skip
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("WANKA_OPS_POISON", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _growth(args) -> None:
    from wanka.ops.sparse_attention import cpu

    if args.threads:
        torch.set_num_threads(args.threads)
    short, long = sorted(args.L)
    H, D, scale = args.H, args.D, args.D**-0.5

    def fwd_bwd(q, k, v, idx, dout) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        torch.autograd.grad(cpu.sparse_attention(q, k, v, idx, scale), (q, k, v), dout)
        return time.perf_counter() - t, time.process_time() - c

    report = {"K": args.K, "H": H, "D": D, "L": [short, long], "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpus": os.cpu_count(), "patterns": {}}  # fmt: skip
    for pattern in args.patterns.split(","):
        inputs = {}
        for L in (short, long):
            idx = torch.load(_ensure_indices(pattern, L, args.K))
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, L, H, D, generator=g).requires_grad_()
            k = torch.randn(1, L, D, generator=g).requires_grad_()
            v = torch.randn(1, L, D, generator=g).requires_grad_()
            inputs[L] = (q, k, v, idx, torch.randn(1, L, H, D, generator=g))

        fwd_bwd(*inputs[short]), fwd_bwd(*inputs[long])  # warm-up
        shorts, longs = [fwd_bwd(*inputs[short])], []
        for _ in range(args.rounds):
            longs.append(fwd_bwd(*inputs[long]))
            shorts.append(fwd_bwd(*inputs[short]))
        wall = [lg[0] / ((a[0] + b[0]) / 2) for lg, a, b in zip(longs, shorts, shorts[1:])]
        cpu_r = [lg[1] / ((a[1] + b[1]) / 2) for lg, a, b in zip(longs, shorts, shorts[1:])]
        work = float((inputs[long][3] >= 0).sum()) / float((inputs[short][3] >= 0).sum())
        row = {"short_s": statistics.median(t[0] for t in shorts),
               "long_s": statistics.median(t[0] for t in longs),
               "ratio_median": statistics.median(wall), "ratio_min": min(wall),
               "ratio_max": max(wall), "cpu_ratio_median": statistics.median(cpu_r),
               "work_ratio": work, "rounds": args.rounds}  # fmt: skip
        report["patterns"][pattern] = row
        print(f"{pattern:<10} K={args.K} H={H} D={D}: fwd+bwd {row['short_s']:.2f} s at L={short}, "
              f"{row['long_s']:.2f} s at L={long}; ratio median {row['ratio_median']:.2f}x "
              f"(range {row['ratio_min']:.2f}-{row['ratio_max']:.2f}, CPU time "
              f"{row['cpu_ratio_median']:.2f}x, {args.rounds} rounds); work ratio {work:.2f}x",
              flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _burners(n: int) -> list[subprocess.Popen]:
    """n busy processes (one core's worth each) standing for other load on the machine. Each
    starts its own session, as another user's job would: where the kernel groups scheduling
    by session (Linux autogroup), a child in this session would only take this benchmark's
    own share of the CPUs."""
    cmd = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(cmd, start_new_session=True) for _ in range(n)]


def _thread_counts(args) -> None:
    from wanka.ops.sparse_attention import cpu, reference

    counts = [int(x) for x in args.thread_counts.split(",")]
    L, K, H, D = args.L[0], args.K, args.H, args.D
    scale = D**-0.5
    fns = {"reference": reference.sparse_attention, "cpu": cpu.sparse_attention}

    def fwd_bwd(fn, q, k, v, idx, dout) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        torch.autograd.grad(fn(q, k, v, idx, scale), (q, k, v), dout)
        return time.perf_counter() - t, time.process_time() - c

    report = {"L": L, "K": K, "H": H, "D": D, "threads": counts, "compete": args.compete,
              "rounds": args.rounds, "torch": torch.__version__, "cpus": os.cpu_count(),
              "loadavg_start": os.getloadavg(), "patterns": {}}  # fmt: skip
    burners = _burners(args.compete)
    try:
        for pattern in args.patterns.split(","):
            idx = torch.load(_ensure_indices(pattern, L, K))
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, L, H, D, generator=g).requires_grad_()
            k = torch.randn(1, L, D, generator=g).requires_grad_()
            v = torch.randn(1, L, D, generator=g).requires_grad_()
            dout = torch.randn(1, L, H, D, generator=g)
            for n in counts:  # warm-up: the cpu backend's workers, first touches
                torch.set_num_threads(n)
                fwd_bwd(fns["cpu"], q, k, v, idx, dout)
            times = {(impl, n): [] for impl in fns for n in counts}
            loads = []
            for _ in range(args.rounds):
                for n in counts:
                    torch.set_num_threads(n)
                    for impl, fn in fns.items():
                        times[impl, n].append(fwd_bwd(fn, q, k, v, idx, dout))
                loads.append(os.getloadavg()[0])
            rows = {"loadavg_per_round": loads}
            for n in counts:
                ref = [x[0] for x in times["reference", n]]
                mine = [x[0] for x in times["cpu", n]]
                ref_c = [x[1] for x in times["reference", n]]
                mine_c = [x[1] for x in times["cpu", n]]
                sp = [a / b for a, b in zip(ref, mine)]
                rows[n] = {"reference_s": statistics.median(ref), "cpu_s": statistics.median(mine),
                           "speedup_median": statistics.median(sp), "speedup_min": min(sp),
                           "speedup_max": max(sp), "reference_all": ref, "cpu_all": mine,
                           "reference_cpu_time_all": ref_c, "cpu_cpu_time_all": mine_c}  # fmt: skip
                print(f"{pattern:<10} L={L} K={K} threads={n} compete={args.compete}: reference "
                      f"{rows[n]['reference_s']:.2f} s, cpu {rows[n]['cpu_s']:.2f} s, speed-up "
                      f"median {rows[n]['speedup_median']:.2f}x (range {min(sp):.2f}-"
                      f"{max(sp):.2f}, {args.rounds} rounds); process CPU time "
                      f"{statistics.median(ref_c):.2f} / {statistics.median(mine_c):.2f} s",
                      flush=True)  # fmt: skip
            report["patterns"][pattern] = rows
    finally:
        for p in burners:
            p.kill()
            p.wait()
    report["loadavg_end"] = os.getloadavg()
    print(f"# load average at start {report['loadavg_start'][0]:.1f}, "
          f"at end {report['loadavg_end'][0]:.1f} (1 min)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="cpu")
    p.add_argument("--pattern", default="realistic")
    p.add_argument("--L", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--K", type=int, default=1024)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--heads", default="16x64,4x32", help="HxD list for the table")
    p.add_argument("--patterns", default="realistic,random")
    p.add_argument("--impls", default="reference,cpu")
    p.add_argument("--ref-max-L", type=int, default=8192, help="skip the reference above this L")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--growth", action="store_true", help="long/short fwd+bwd ratio (see above)")
    p.add_argument("--rounds", type=int, default=5,
                   help="--growth: long runs per pattern; --thread-counts: rounds")  # fmt: skip
    p.add_argument("--json", default="", help="--growth / --thread-counts: also write JSON")
    p.add_argument(
        "--thread-counts",
        default="",
        help="e.g. 1,2: speed-up over the reference per torch thread count (above)",
    )
    p.add_argument("--compete", type=int, default=0,
                   help="--thread-counts: busy processes running alongside")  # fmt: skip
    args = p.parse_args()
    if args.thread_counts:
        if args.rounds < 1:
            p.error(f"--rounds must be at least 1, got {args.rounds}")
        return _thread_counts(args)
    if args.growth:
        if len(args.L) != 2:
            p.error("--growth takes exactly two lengths, e.g. --L 8192 32768")
        if args.rounds < 1:
            p.error(f"--rounds must be at least 1, got {args.rounds}")
        return _growth(args)
    if args.child:
        args.L = args.L[0]
        return _child(args)

    heads = [tuple(int(x) for x in hd.split("x")) for hd in args.heads.split(",")]
    patterns, impls = args.patterns.split(","), args.impls.split(",")
    print(f"# K={args.K} B=1 fp32, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"median of {args.repeats} after 1 warm-up; peak = RSS growth over inputs")  # fmt: skip
    print("# wall = median wall-clock s; cpu = median process CPU s (all threads; on a shared,")
    print("# oversubscribed machine it is the steadier number, best with --threads 1)")
    hdr = f"{'impl':<10}{'pattern':<10}{'L':>6}{'H':>4}{'D':>5}{'fwd wall':>9}{'fwd cpu':>9}"
    hdr += f"{'f+b wall':>9}{'f+b cpu':>9}{'peak MiB':>9}{'x wall':>8}{'x cpu':>7}{'x mem':>7}"
    print(hdr)
    for L in args.L:
        for H, D in heads:
            for pattern in patterns:
                _ensure_indices(pattern, L, args.K)
                ref = None
                for impl in impls:
                    if impl == "reference" and L > args.ref_max_L:
                        continue
                    r = _run_case(impl, pattern, L, args.K, H, D, args)
                    if "error" in r:
                        print(f"{impl:<10}{pattern:<10}{L:>6}{H:>4}{D:>5}  error: {r['error']}")
                        continue
                    if impl == "reference":
                        ref = r
                    sp = spc = mem = ""
                    if ref is not None and impl != "reference":
                        sp = f"{ref['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}"
                        spc = f"{ref['fwd_bwd_cpu_s'] / r['fwd_bwd_cpu_s']:.2f}"
                        mem = f"{ref['peak_mib'] / max(r['peak_mib'], 1.0):.0f}"
                    print(f"{impl:<10}{pattern:<10}{L:>6}{H:>4}{D:>5}{r['fwd_s']:>9.2f}"
                          f"{r['fwd_cpu_s']:>9.2f}{r['fwd_bwd_s']:>9.2f}{r['fwd_bwd_cpu_s']:>9.2f}"
                          f"{r['peak_mib']:>9.0f}{sp:>8}{spc:>7}{mem:>7}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
