"""`wanka bench train`: training throughput, step time, memory and MFU for the tiny and small
flavors on 1 and 2 local ranks.

Each case is a real `wanka train` run in a subprocess (2 ranks go through torchrun, gloo,
FSDP2, with ep = nproc so 2 ranks are dp 2 x ep 2). The GLOBAL batch is the same for 1 and 2
ranks (the micro-batch is divided by nproc), so tokens/s compare like for like. The first
WARMUP_STEPS steps are discarded; step time is the median of the rest, tokens/s is
global batch tokens / that median.

Variants: `ac_modes` (activation checkpointing off / full / selective) and `compiles` (eager,
torch.compile per block) multiply the cases; the variants of one flavor x rank count run back
to back, so their ratios ("vs base": tokens/s and peak memory over the same flavor and ranks
with AC off, eager) compare runs made under the same machine load. `seq_len` and
`global_batch` override the preset shapes (e.g. small at seq_len 4096, batch 1, for memory).

Threads: the machine's cores are split evenly over the ranks (OMP_NUM_THREADS = cores / nproc),
so 1 rank x 2 threads and 2 ranks x 1 thread use the same cores. The MFU denominator is
therefore the whole machine: fp32 matmul FLOP/s measured in one process with torch threads =
all cores (measured before and after the cases; the larger is used), for 1 and 2 ranks alike.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from wanka.bench.flops import flops_breakdown, measure_matmul_peak

WARMUP_STEPS = 2
FLAVORS = ("tiny", "small")
NPROCS = (1, 2)


@dataclass(frozen=True)
class CaseSpec:
    flavor: str
    seq_len: int
    global_batch: int  # sequences per step, summed over ranks
    steps: int
    ac: str = "off"  # train.activation_checkpointing
    compile: bool = False  # train.compile


def case_specs(
    quick: bool, steps: int | None, seq_len: int | None = None, global_batch: int | None = None
) -> dict[str, CaseSpec]:
    """Fixed shapes per flavor. small uses seq_len 512 > index_topk 256, so its attention is
    DSA-sparse (the top-k path and the lightning indexer run). `seq_len` / `global_batch`
    override every flavor's."""
    if quick:
        specs = {"tiny": CaseSpec("tiny", 256, 8, 12), "small": CaseSpec("small", 512, 2, 6)}
    else:
        specs = {"tiny": CaseSpec("tiny", 256, 8, 50), "small": CaseSpec("small", 512, 4, 20)}
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
        specs = {k: replace(s, steps=steps) for k, s in specs.items()}
    for name, v in (("seq_len", seq_len), ("global_batch", global_batch)):
        if v is not None:
            if v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
            specs = {k: replace(s, **{name: v}) for k, s in specs.items()}
    return specs


def variant_name(spec: CaseSpec) -> str:
    """'eager' / 'compile', with the activation checkpointing mode when it is not off."""
    name = "compile" if spec.compile else "eager"
    return name if spec.ac == "off" else f"{name}+ac-{spec.ac}"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpus": _cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _repo_config() -> list[str]:
    demo = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"
    return [str(demo)] if demo.is_file() else []


def train_command(spec: CaseSpec, nproc: int, run_dir: Path) -> list[str]:
    if spec.global_batch % nproc:
        raise ValueError(f"global batch {spec.global_batch} not divisible by nproc {nproc}")
    sets = {
        "model.flavor": f'"{spec.flavor}"',
        "data.seq_len": spec.seq_len,
        "data.val_batches": 1,
        "train.steps": spec.steps,
        "train.micro_batch_size": spec.global_batch // nproc,
        "train.grad_accum": 1,
        "train.eval_every": 1_000_000,
        "train.activation_checkpointing": f'"{spec.ac}"',
        "train.compile": str(spec.compile).lower(),
        "train.log_every": 1,
        "parallel.dp_shard": -1,
        "parallel.ep": nproc,
        "checkpoint.enable": "false",
        "checkpoint.load": '"none"',
        "run.tensorboard": "false",
        "run.dir": json.dumps(str(run_dir)),
    }
    cmd = [sys.executable, "-m", "wanka.cli", "train", *_repo_config(), "--nproc", str(nproc)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def read_step_times(metrics_file: Path) -> list[float]:
    times = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "train" and "step_time" in row:
            times[int(row["step"])] = float(row["step_time"])
    return [times[s] for s in sorted(times)]


def run_case(
    spec: CaseSpec, nproc: int, root: Path, peak_flops: float, timeout_s: float
) -> dict[str, Any]:
    """One `wanka train` subprocess; returns the case row (with "error" set if it failed)."""
    from wanka.config import load_config

    run_dir = root / f"{spec.flavor}-n{nproc}-{variant_name(spec).replace('+', '-')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    threads = max(1, _cpus() // nproc)
    cfg = load_config(None, [f'model.flavor="{spec.flavor}"']).model
    fb = flops_breakdown(cfg, spec.seq_len)
    row: dict[str, Any] = {
        "flavor": spec.flavor, "nproc": nproc, "dp": nproc, "ep": nproc,
        "threads_per_rank": threads, "seq_len": spec.seq_len,
        "activation_checkpointing": spec.ac, "compile": spec.compile,
        "variant": variant_name(spec),
        "micro_batch_size": spec.global_batch // nproc, "global_batch_seqs": spec.global_batch,
        "global_batch_tokens": spec.global_batch * spec.seq_len, "steps": spec.steps,
        "sparse_attention": spec.seq_len > cfg.index_topk,
        "flops_per_token": fb["total"], "flops_breakdown_fwd": fb, "run_dir": str(run_dir),
        "ok": False, "error": None,
    }  # fmt: skip
    cmd = train_command(spec, nproc, run_dir)
    row["command"] = " ".join(cmd)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log_path = run_dir / "bench.log"
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            rc = subprocess.call(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            )
    except subprocess.TimeoutExpired:
        rc = None
    row["process_wall_s"] = time.perf_counter() - t0
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit code {rc}"
        row["error"] = f"wanka train {why}; log {log_path}:\n" + "\n".join(tail)
        return row
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        times = read_step_times(run_dir / "metrics.jsonl")
    except (OSError, ValueError) as e:
        row["error"] = f"could not read run results: {e}"
        return row
    drop = WARMUP_STEPS if len(times) > WARMUP_STEPS else 0
    kept = times[drop:]
    if not kept:
        row["error"] = "no train steps in metrics.jsonl"
        return row
    step = statistics.median(kept)
    tps = row["global_batch_tokens"] / step
    achieved = fb["total"] * tps
    row.update({
        "warmup_steps_discarded": drop, "measured_steps": len(kept),
        "step_time_s": step, "step_time_min_s": min(kept), "step_time_max_s": max(kept),
        "tokens_per_s": tps, "peak_memory_mb": summary.get("peak_memory_mb"),
        "achieved_flops": achieved, "mfu": achieved / peak_flops if peak_flops > 0 else None,
        "wall_time_s": summary.get("wall_time_s"), "val_loss": summary.get("val_loss"),
        "train_loss": summary.get("train_loss"), "ok": True,
    })  # fmt: skip
    return row


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(cases: list[dict[str, Any]]) -> str:
    head = ("flavor", "ranks", "variant", "batch tok", "tokens/s", "step s", "peak MB/rank",
            "FLOPs/tok", "GFLOP/s", "MFU", "2r/1r", "vs base tok/s", "vs base mem")  # fmt: skip
    rows = [head]
    for c in cases:
        if not c["ok"]:
            rows.append((c["flavor"], str(c["nproc"]), c.get("variant", "-"),
                         str(c["global_batch_tokens"]), "FAILED", *["-"] * 8))  # fmt: skip
            continue
        rows.append((
            c["flavor"], f"{c['nproc']} (dp{c['dp']}xep{c['ep']})", c.get("variant", "eager"),
            str(c["global_batch_tokens"]), _fmt(c["tokens_per_s"], ",.0f"),
            _fmt(c["step_time_s"], ".3f"), _fmt(c["peak_memory_mb"], ",.0f"),
            _fmt(c["flops_per_token"] / 1e6, ".2f") + "M",
            _fmt(c["achieved_flops"] / 1e9, ".2f"),
            _fmt(None if c["mfu"] is None else 100 * c["mfu"], ".1f") + "%",
            _fmt(c.get("speedup_vs_1_rank"), ".2f"),
            _fmt(c.get("tokens_per_s_vs_base"), ".2f"), _fmt(c.get("peak_memory_vs_base"), ".2f"),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def run_bench(
    quick: bool,
    out: Path,
    steps: int | None,
    flavors: tuple[str, ...] = FLAVORS,
    nprocs: tuple[int, ...] = NPROCS,
    peak_seconds: float = 2.0,
    ac_modes: tuple[str, ...] = ("off",),
    compiles: tuple[bool, ...] = (False,),
    seq_len: int | None = None,
    global_batch: int | None = None,
) -> dict[str, Any]:
    from wanka.distributed.activation_checkpoint import AC_MODES

    for mode in ac_modes:
        if mode not in AC_MODES:
            raise ValueError(f"activation checkpointing mode {mode!r}: expected one of {AC_MODES}")
    specs = case_specs(quick, steps, seq_len, global_batch)
    if unknown := [f for f in flavors if f not in specs]:
        raise ValueError(
            f"no benchmark shape for flavor(s) {unknown}: expected some of {list(specs)}"
        )
    root = out.parent / (out.stem + "_runs")
    cpus = _cpus()
    machine = machine_info()  # date = start of the benchmark
    print(f"measuring fp32 matmul peak ({cpus} threads)...", flush=True)
    peak_before = measure_matmul_peak(peak_seconds, threads=cpus)
    cases: list[dict[str, Any]] = []
    timeout = 600.0 if quick else 1200.0
    variants = [(c, ac) for c in compiles for ac in ac_modes]
    for flavor in flavors:
        for nproc, (comp, ac) in ((n, v) for n in nprocs for v in variants):
            spec = replace(specs[flavor], ac=ac, compile=comp)
            print(f"[{flavor} x {nproc} rank(s), {variant_name(spec)}] seq_len {spec.seq_len}, "
                  f"global batch {spec.global_batch}, {spec.steps} steps ...", flush=True)  # fmt: skip
            try:
                row = run_case(spec, nproc, root, peak_before, timeout)
            except Exception as e:  # a broken case is reported, the others still run
                row = {"flavor": flavor, "nproc": nproc, "ok": False, "error": repr(e),
                       "activation_checkpointing": ac, "compile": comp,
                       "variant": variant_name(spec),
                       "global_batch_tokens": spec.global_batch * spec.seq_len}  # fmt: skip
            if row["ok"]:
                print(f"    {row['tokens_per_s']:,.0f} tok/s, step {row['step_time_s']:.3f} s",
                      flush=True)  # fmt: skip
            else:
                print(f"    FAILED: {row['error']}", file=sys.stderr, flush=True)
            cases.append(row)
    peak_after = measure_matmul_peak(peak_seconds, threads=cpus)
    peak = max(peak_before, peak_after)
    for c in cases:  # MFU against the larger (less disturbed) peak measurement
        if c["ok"]:
            c["mfu"] = c["achieved_flops"] / peak
    add_ratios(cases)
    return {
        "machine": machine,
        "torch": torch.__version__,
        "torch_threads_for_peak": cpus,
        "matmul_peak_flops": peak,
        "matmul_peak_flops_before": peak_before,
        "matmul_peak_flops_after": peak_after,
        "mfu_denominator": "matmul_peak_flops: whole machine (fp32, one process, all cores), "
        "for every case whatever its rank count",
        "quick": quick,
        "warmup_steps_discarded": WARMUP_STEPS,
        "cases": cases,
    }


def add_ratios(cases: list[dict[str, Any]]) -> None:
    """2r/1r: over the 1-rank case of the same flavor and variant. vs base: tokens/s and peak
    memory over the same flavor and rank count with AC off, eager (when that case ran)."""

    def find(flavor, nproc, ac, comp):
        for o in cases:
            if (o["ok"] and o["flavor"] == flavor and o["nproc"] == nproc
                    and o.get("activation_checkpointing", "off") == ac
                    and o.get("compile", False) == comp):  # fmt: skip
                return o
        return None

    for c in cases:
        if not c["ok"]:
            continue
        ac, comp = c.get("activation_checkpointing", "off"), c.get("compile", False)
        one = find(c["flavor"], 1, ac, comp)
        if one is not None:
            c["speedup_vs_1_rank"] = c["tokens_per_s"] / one["tokens_per_s"]
        base = find(c["flavor"], c["nproc"], "off", False)
        if base is not None and base is not c:
            c["tokens_per_s_vs_base"] = c["tokens_per_s"] / base["tokens_per_s"]
            if c.get("peak_memory_mb") and base.get("peak_memory_mb"):
                c["peak_memory_vs_base"] = c["peak_memory_mb"] / base["peak_memory_mb"]


def _csv(text: str | None, cast=str, flag: str = "--nprocs") -> tuple | None:
    if text is None:
        return None
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if cast is int and not all(x.isdigit() and int(x) > 0 for x in items):
        raise ValueError(f"{flag} {text!r}: give positive whole numbers separated by commas, "
                         "e.g. 1,2")  # fmt: skip
    return tuple(map(cast, items))


COMPILE_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def bench_train_main(
    quick: bool,
    out: Path,
    steps: int | None,
    flavors: str | None = None,
    nprocs: str | None = None,
    ac: str = "off",
    compile: str = "off",
    seq_len: int | None = None,
    global_batch: int | None = None,
) -> int:
    """The CLI's entry: comma lists for flavors, rank counts and AC modes; compile is
    off | on | both (both: eager and compiled side by side)."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {compile!r}")
    result = run_bench(
        quick, out, steps, flavors=_csv(flavors) or FLAVORS, nprocs=_csv(nprocs, int) or NPROCS,
        ac_modes=_csv(ac) or ("off",), compiles=COMPILE_CHOICES[compile], seq_len=seq_len,
        global_batch=global_batch,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    m = result["machine"]
    print(f"\n{m['cpu_model']}, {m['cpus']} CPUs, torch {result['torch']}, matmul peak "
          f"{result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s (fp32, {m['cpus']} threads)")  # fmt: skip
    print(format_table(result["cases"]))
    print(f"wrote {out}")
    failed = [c for c in result["cases"] if not c["ok"]]
    return 1 if failed else 0
