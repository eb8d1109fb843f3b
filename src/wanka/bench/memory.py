"""`wanka bench memory`: the memory estimate (models/stats.py) against measured training runs.

Each case is a short real training job: the trainer's own `run()` on 1 or 2 spawned gloo
ranks (as tests/distributed/helpers.py does), checkpoints off. The estimate is compared with
the measured peak of the largest rank.

What is measured on CPU, and how. The estimate covers what the trainer allocates for the model
(parameters, optimizer state, gradients, activations, buffers), not what the process held
before: the interpreter, torch's libraries, the process group and the data are not the model's.
So each rank wraps two trainer functions (nothing in the trainer is changed):

* `Transformer(...)` in `trainer.setup` (the model is built right after the data, on the meta
  device, then materialised by `to_empty`): right after the meta construction (which allocates
  no tensor, but whose `torch.device("meta")` context imports torch._dynamo the first time:
  ~25 MiB of interpreter state) the rank resets its high-water mark (writing "5" to
  /proc/self/clear_refs sets VmHWM to the current RSS, as bench/ops.py does) and records
  RssAnon as the baseline;
* `train_step`: before each step the high-water mark is reset again and RssAnon read; after the
  step VmHWM is read. The step's peak is VmHWM less the file-backed and shared pages held at
  the end of the step (RssFile + RssShmem: library code and the memory-mapped dataset that the
  first steps page in are not allocations; those pages only grow within a step, so this is the
  anonymous memory at the peak, at most slightly under it) less the baseline RssAnon.

glibc's mmap threshold is pinned in the ranks (MALLOC_ENV): otherwise freed tensors stay
resident in malloc's heaps and RSS measures the allocator's retention, not the allocations.

The measured peak is the largest step peak (the first step has no AdamW moments yet, later
steps do), and `init_peak` the high-water mark from the model build to the first step. The
anonymous RSS between steps (`state`) is the live state without gradients: master params,
AdamW moments, buffers (plus whatever malloc keeps of freed memory), checked against the
estimate's `master_params + adam_moments`.

    python -m wanka.bench.memory [--quick] [--out runs/bench/memory.json]
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wanka.bench.output import write_out

MIB = 1024**2
# glibc serves allocations above its mmap threshold with mmap and returns them on free, below it
# from heaps that keep freed memory. The threshold starts at 128 KiB but rises to the size of
# each mmapped block freed (up to 32 MiB), so after the first step the activations come from the
# heap and stay resident when freed: RSS then counts free memory (tiny: 155 MiB resident between
# steps for 23 MiB of live state, and a peak creeping up step by step). Pinning the threshold
# (setting it disables the dynamic rise) makes every tensor of 64 KiB or more its own mapping,
# so RSS follows what the trainer allocates. `malloc="default"` measures without it.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
TARGET_ERROR = 0.20  # |estimate - measured| / measured on CPU


@dataclass(frozen=True)
class MemCase:
    flavor: str
    nproc: int
    ep: int
    seq_len: int
    micro_batch: int
    steps: int = 3
    ac: str = "off"
    cp: int = 1
    cp_layout: str = "dynamic"

    @property
    def layout(self) -> str:
        if self.cp > 1:
            return f"dp{self.nproc // self.cp}xcp{self.cp}-{self.cp_layout}"
        return f"dp{self.nproc}xep{self.ep}"

    @property
    def name(self) -> str:
        return f"{self.flavor}-{self.layout}-L{self.seq_len}-mb{self.micro_batch}-ac{self.ac}"


def cases(quick: bool) -> list[MemCase]:
    """tiny and small at two layouts each: 1 rank (dp 1) and 2 ranks (dp 2 x ep 2)."""
    steps = 3
    tiny = [MemCase("tiny", 1, 1, 256, 8, steps), MemCase("tiny", 2, 2, 256, 8, steps)]
    if quick:
        small = [MemCase("small", 1, 1, 1024, 1, steps), MemCase("small", 2, 2, 1024, 1, steps)]
    else:
        small = [MemCase("small", 1, 1, 2048, 1, steps), MemCase("small", 2, 2, 2048, 1, steps)]
    return tiny + small


def cp_cases(quick: bool) -> list[MemCase]:
    """Context parallelism's memory claim: cp = 4 runs a 4x longer sequence at about the
    per-rank peak of cp = 1 (tiny; both CP layouts that differ in tokens per rank)."""
    L = 2048 if quick else 4096
    return [
        MemCase("tiny", 1, 1, L, 1, 3),
        MemCase("tiny", 4, 1, 4 * L, 1, 3, cp=4, cp_layout="head_tail"),
        MemCase("tiny", 4, 1, 4 * L, 1, 3, cp=4, cp_layout="dynamic"),
    ]


def cp_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cp > 1 row's measured peak over the cp = 1 row's (the target: 1 +- 0.15)."""
    base = next((r for r in rows if r.get("cp", 1) == 1 and "measured_mib" in r), None)
    out = []
    for r in rows:
        if r.get("cp", 1) > 1 and base is not None and "measured_mib" in r:
            ratio = r["measured_mib"] / base["measured_mib"]
            out.append({"case": r["case"], "vs": base["case"], "peak_ratio": ratio,
                        "estimate_ratio": r["estimate_mib"] / base["estimate_mib"],
                        "within_15pct": abs(ratio - 1) <= 0.15})  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Inside each rank.


def _status() -> dict[str, int]:
    """Bytes of the /proc/self/status memory fields."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _hwm_reset_problem() -> str | None:
    """None where a reset of the peak RSS takes; else why not. A write some kernels accept
    and ignore: 64 MiB touched and freed must leave the peak once reset."""
    # Its own mapping, pages touched one by one: memory malloc hands out may be resident
    # already (a heap never trimmed holds freed blocks), which moves no peak at all.
    blob = mmap.mmap(-1, 64 << 20)
    for off in range(0, len(blob), mmap.PAGESIZE):
        blob[off] = 1
    blob.close()
    try:
        _reset_hwm()
        st = _status()
    except OSError as e:
        return f"is refused ({e.strerror})"
    if st["VmHWM"] > st["VmRSS"] + (32 << 20):
        return "is accepted but does not reset the peak"
    return None


class RssProbe:
    """Peak anonymous RSS growth over a baseline, per training step (see the module docstring)."""

    def __init__(self) -> None:
        self.base: dict[str, int] = {}
        self.init_peak = 0
        self.steps: list[dict[str, float]] = []
        self._start: dict[str, int] = {}
        self.ac_applied: bool | None = None
        self.ac_by_bench = False  # the bench passed train.activation_checkpointing on

    def _anon_peak(self, st: dict[str, int]) -> int:
        return st["VmHWM"] - st["RssFile"] - st.get("RssShmem", 0) - self.base["RssAnon"]

    def baseline(self) -> None:
        _reset_hwm()
        self.base = _status()

    def step_start(self, step: int) -> None:
        st = _status()
        if not self.steps:
            self.init_peak = self._anon_peak(st)
        self._start = st
        _reset_hwm()

    def step_end(self, step: int) -> None:
        st = _status()
        self.steps.append({
            "step": step + 1,
            "state_mib": (self._start["RssAnon"] - self.base["RssAnon"]) / MIB,
            "peak_mib": self._anon_peak(st) / MIB,
            "file_growth_mib": (st["RssFile"] - self._start["RssFile"]) / MIB,
        })  # fmt: skip

    def result(self) -> dict[str, Any]:
        later = [s for s in self.steps if s["step"] > 1] or self.steps
        return {
            "baseline_rss_mib": self.base.get("VmRSS", 0) / MIB,
            "init_peak_mib": self.init_peak / MIB,
            "peak_mib": max(s["peak_mib"] for s in self.steps),
            "state_mib": later[-1]["state_mib"],
            "ac_applied": self.ac_applied,
            "ac_by_bench": self.ac_by_bench,
            "steps": self.steps,
        }


def _rank_main(rank: int, world: int, port: int, overrides: list[str], out: str, threads: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    import torch

    torch.set_num_threads(threads)
    from wanka.config import load_config
    from wanka.train import trainer

    cfg = load_config(None, overrides)
    probe = RssProbe()
    build, step_fn, par = trainer.Transformer, trainer.train_step, trainer.parallelize

    def measured_build(*args, **kwargs):
        model = build(*args, **kwargs)  # on the meta device: no storage yet
        probe.baseline()
        return model

    def measured_step(job, step):
        probe.step_start(step)
        try:
            return step_fn(job, step)
        finally:
            probe.step_end(step)

    def measured_parallelize(model, dims, **kwargs):
        mode = cfg.train.activation_checkpointing
        if "ac_mode" not in kwargs and mode != "off" and _takes(par, "ac_mode"):
            kwargs["ac_mode"] = mode  # the trainer does not pass the mode on (yet)
            probe.ac_by_bench = True
        out = par(model, dims, **kwargs)
        probe.ac_applied = ac_applied(model)
        return out

    trainer.Transformer, trainer.train_step = measured_build, measured_step
    trainer.parallelize = measured_parallelize
    trainer.run(cfg)
    Path(out, f"rank{rank}.json").write_text(json.dumps(probe.result(), indent=2))


def ac_applied(model: Any) -> bool:
    """Whether activation checkpointing wraps the model's blocks (distributed/
    activation_checkpoint.py replaces `forward` on the block, MoE or FFN instance)."""
    blocks = [*model.layers.values(), *(m.block for m in model.mtp)]
    mods = blocks + [x for b in blocks for x in (b.moe, b.ffn) if x is not None]
    return any("forward" in vars(m) for m in mods)


def _takes(fn: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_overrides(case: MemCase, run_dir: Path, data_path: str | None = None) -> list[str]:
    sets = {
        "model.flavor": json.dumps(case.flavor),
        "data.seq_len": case.seq_len,
        "data.val_batches": 1,
        "train.steps": case.steps,
        "train.warmup_steps": 1,
        "train.micro_batch_size": case.micro_batch,
        "train.grad_accum": 1,
        "train.eval_every": 1_000_000,
        "train.activation_checkpointing": json.dumps(case.ac),
        "parallel.dp_shard": -1,
        "parallel.ep": case.ep,
        "parallel.cp": case.cp,
        "parallel.cp_layout": json.dumps(case.cp_layout),
        "checkpoint.enable": "false",
        "checkpoint.load": '"none"',
        "run.tensorboard": "false",
        "run.device": '"cpu"',
        "run.dir": json.dumps(str(run_dir)),
    }
    if case.cp > 1:
        sets["model.max_seq_len"] = case.seq_len
    if data_path is not None:
        sets["data.path"] = json.dumps(str(data_path))
    return [f"{k}={v}" for k, v in sets.items()]


def estimate_for(case: MemCase, overrides: list[str]):
    from wanka.config import load_config
    from wanka.models.stats import job_memory

    cfg = load_config(None, overrides)
    return job_memory(cfg, case.nproc, "cpu")


def measure_case(case: MemCase, root: Path, data_path: str | None = None, threads: int = 1,
                 malloc: str = "fixed") -> dict[str, Any]:  # fmt: skip
    """Run one case's ranks; returns its row (estimate, measurement, error). `malloc`:
    "fixed" pins glibc's mmap threshold (see MALLOC_ENV), "default" leaves glibc alone."""
    import shutil

    import torch.multiprocessing as mp

    run_dir = root / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = case_overrides(case, run_dir, data_path)
    row: dict[str, Any] = {
        "case": case.name, "flavor": case.flavor, "layout": case.layout, "nproc": case.nproc,
        "dp": case.nproc, "ep": case.ep, "seq_len": case.seq_len,
        "micro_batch": case.micro_batch, "ac": case.ac, "steps": case.steps, "ok": False,
        "cp": case.cp, "cp_layout": case.cp_layout,
    }  # fmt: skip
    row.update(estimate_fields(case, overrides))
    row["malloc"] = malloc
    env = MALLOC_ENV if malloc == "fixed" else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by glibc when the spawned ranks start
    t0 = time.perf_counter()
    try:
        mp.spawn(_rank_main, args=(case.nproc, _free_port(), overrides, str(run_dir), threads),
                 nprocs=case.nproc, join=True)  # fmt: skip
    except Exception as e:  # a broken case is reported, the others still run
        row["error"] = repr(e)[-2000:]
        return row
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row["wall_s"] = time.perf_counter() - t0
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(case.nproc)]
    worst = max(ranks, key=lambda r: r["peak_mib"])
    row.update({
        "ranks": ranks, "measured_mib": worst["peak_mib"], "measured_state_mib": worst["state_mib"],
        "measured_init_mib": max(r["init_peak_mib"] for r in ranks),
        "ac_applied": worst["ac_applied"], "ac_by_bench": worst["ac_by_bench"],
        "moe_max_load": _max_load(run_dir),
    })  # fmt: skip
    if case.ac != "off" and not worst["ac_applied"]:
        row["error"] = f"the trainer did not apply activation checkpointing {case.ac!r}"
        return row
    _compare(row)
    return row


def estimate_fields(case: MemCase, overrides: list[str]) -> dict[str, Any]:
    est = estimate_for(case, overrides)
    c = est.components
    return {
        "settings": est.settings.describe(), "estimate_mib": est.train_peak / MIB,
        "estimate_peak_at": est.peak_at,
        "estimate_components_mib": {k: v / MIB for k, v in c.items()},
        "estimate_state_mib": (c["master_params"] + c["adam_moments"]) / MIB,
        "estimate_init_mib": est.init_peak / MIB,
    }  # fmt: skip


def _compare(row: dict[str, Any]) -> None:
    row["error_pct"] = 100 * (row["estimate_mib"] - row["measured_mib"]) / row["measured_mib"]
    row["ok"] = abs(row["error_pct"]) <= 100 * TARGET_ERROR


def reestimate(out: Path) -> dict[str, Any]:
    """Recompute the estimate columns of a written result (after a change to the model of
    memory) without running the jobs again; rewrites the JSON and the Markdown table."""
    out = Path(out)
    result = json.loads(out.read_text())
    for row in result["cases"]:
        case = MemCase(row["flavor"], row["nproc"], row["ep"], row["seq_len"],
                       row["micro_batch"], row["steps"], row["ac"], row.get("cp", 1),
                       row.get("cp_layout", "dynamic"))  # fmt: skip
        row.update(estimate_fields(case, case_overrides(case, out.parent / case.name)))
        if "measured_mib" in row and not (row["ac"] != "off" and not row.get("ac_applied")):
            _compare(row)
    _write(out, result)
    return result


def _write(out: Path, result: dict[str, Any]) -> str:
    write_out(out, json.dumps(result, indent=2))
    table = format_table(result["cases"])
    write_out(out.with_suffix(".md"), table + "\n")
    return table


def _max_load(run_dir: Path) -> float | None:
    """The run's largest logged MoE load imbalance (max expert load / mean, mean over layers):
    the estimate assumes balanced routing; skew moves expert rows between EP ranks."""
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return None
    loads = [r["moe_max_load"] for r in rows if r.get("kind") == "train" and "moe_max_load" in r]
    return max(loads) if loads else None


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("| flavor | layout | seq | micro-batch | AC mode | estimate MiB | measured MiB | "
            "error % | state est / measured MiB | estimate peak at | max expert load |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        if "measured_mib" not in r or "error_pct" not in r:
            lines.append(f"| {r['flavor']} | {r['layout']} | {r['seq_len']} | {r['micro_batch']} "
                         f"| {r['ac']} | {r['estimate_mib']:.0f} | - | failed: "
                         f"{r.get('error', '?')[:80]} | - | - | - |")  # fmt: skip
            continue
        lines.append(
            f"| {r['flavor']} | {r['layout']} | {r['seq_len']} | {r['micro_batch']} | {r['ac']} "
            f"| {r['estimate_mib']:.0f} | {r['measured_mib']:.0f} | {r['error_pct']:+.1f} "
            f"| {r['estimate_state_mib']:.0f} / {r['measured_state_mib']:.0f} "
            f"| {r['estimate_peak_at']} | {_fmt(r.get('moe_max_load'), '.1f')}x |"
        )
    return "\n".join(lines)


def bench_memory_main(out: Path, quick: bool, modes: tuple[str, ...] = ("off",),
                      cp: bool = False) -> int:  # fmt: skip
    """Run every case (for each activation checkpointing mode), write JSON and a Markdown
    table next to it; exit 1 when a case failed or missed the 20% target. `cp`: the context
    parallelism cases instead (cp_cases), with their peak ratios."""
    import platform

    import torch

    out = Path(out)
    root = out.parent / (out.stem + "_runs")
    if cp and set(modes) != {"off"}:
        raise ValueError("--cp runs with --ac off only: context parallelism refuses activation "
                         "checkpointing (docs/CONTEXT_PARALLEL.md)")  # fmt: skip
    why = _hwm_reset_problem()
    if why:
        raise ValueError(f"bench memory reads each step's peak by resetting it through "
                         f"/proc/self/clear_refs, which {why} here; run it on a Linux host or "
                         "container where that works") from None  # fmt: skip
    rows = []
    for mode in modes:
        for c in cp_cases(quick) if cp else cases(quick):
            c = dataclasses.replace(c, ac=mode)
            print(f"[{c.name}] ...", flush=True)
            row = measure_case(c, root)
            if "error_pct" in row:
                print(f"    estimate {row['estimate_mib']:.0f} MiB, measured "
                      f"{row['measured_mib']:.0f} MiB ({row['error_pct']:+.1f}%)", flush=True)  # fmt: skip
            else:
                print(f"    FAILED: {row.get('error')}", file=sys.stderr, flush=True)
            rows.append(row)
    result = {
        "torch": torch.__version__, "platform": platform.platform(), "quick": quick,
        "method": "peak anonymous RSS growth per rank over RssAnon just before the model is "
        "built (see wanka.bench.memory); max over ranks", "target_error": TARGET_ERROR,
        "cases": rows,
    }  # fmt: skip
    if cp:
        result["cp_peak_ratios"] = cp_summary(rows)
    table = _write(out, result)
    print(table)
    for r in result.get("cp_peak_ratios", []):
        print(f"{r['case']}: measured peak {r['peak_ratio']:.2f}x {r['vs']}'s (estimate "
              f"{r['estimate_ratio']:.2f}x); within 15%: {r['within_15pct']}")  # fmt: skip
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m wanka.bench.memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/bench/memory.json")
    p.add_argument("--ac", default="off", help="comma-separated modes: off,full,selective")
    p.add_argument("--reestimate", action="store_true",
                   help="recompute the estimates of an existing --out without running jobs")  # fmt: skip
    a = p.parse_args(argv)
    if a.reestimate:
        print(format_table(reestimate(Path(a.out))["cases"]))
        return 0
    return bench_memory_main(Path(a.out), a.quick, tuple(a.ac.split(",")))


if __name__ == "__main__":
    sys.exit(main())
