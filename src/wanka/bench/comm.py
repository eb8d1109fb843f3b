"""`wanka bench comm`: what gradient communication options cost on the slow inter-node link.

On a cluster-in-a-box of its own (2 nodes x 2 ranks, links shaped to each --gbit in turn)
every case (comm_cases: flat FSDP2 fp32, HSDP, HSDP with compressed all-reduce) is a real
`wanka train --cluster` run. Measured per case and link rate:

- inter-node bytes per step, from the kernel's interface counters (comm_counters): each
  case runs for N1 and for N2 steps, and (B(N2) - B(N1)) / (N2 - N1) is the traffic of one
  step, start-up, final evaluation and teardown cancelling out (same work in both runs). A
  within-run estimate (counters sampled at 20 Hz, read at the times rank 0 logged two steps)
  is kept beside it as a cross-check.
- step time and tokens/s: medians over both runs' steps after the warm-up, from metrics.jsonl.

The convergence check (`--converge-steps N`) trains each case for N steps on this node
(`wanka train --nproc <nodes x ranks>`, no cluster: the link does not change the numbers,
and namespaces and shaping would only add time on a small machine) and compares the final
validation losses with the baseline's.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from wanka.bench import comm_report as report
from wanka.bench.comm_cases import Case
from wanka.bench.comm_counters import CounterSampler, delta, read_sent, window_per_step
from wanka.bench.comm_run import RunFailed, median, read_metrics, run_sets, run_train, train_argv
from wanka.bench.output import write_out

# Short sequences and few rows: compute per step small next to the model's bytes, so the link
# shows in step time on a 2-core machine as it would next to accelerators.
# PowerSGD compresses from the first step here: a 12-step run measures its steady state.
MEASURE_SHAPE = {"data.seq_len": "64", "train.micro_batch_size": "2", "data.val_batches": "2",
                 "comm.powersgd_start": "0"}  # fmt: skip
# Enough tokens per step that 200 steps move the validation loss well clear of its noise.
CONVERGE_SHAPE = {"data.seq_len": "128", "train.micro_batch_size": "4", "data.val_batches": "8"}
CLUSTER = {"name": "wkc", "subnet": "10.231.3.0/24"}  # apart from `cluster up`'s and tests'


def _machine() -> dict:
    from wanka.bench.train import machine_info

    # The load others put on the machine: step times on a shared 2-core box move with it.
    return {**machine_info(), "loadavg": list(os.getloadavg())}


def check_cases(cases: list[Case], opts: dict) -> None:
    """Each run's config must load before anything starts (one line naming the case)."""
    from wanka.config import ConfigError, load_config

    runs = [(MEASURE_SHAPE, opts["steps"][0])] if opts["gbits"] else []
    runs += [(CONVERGE_SHAPE, opts["converge_steps"])] if opts["converge_steps"] else []
    for c in cases:
        for shape, steps in runs:
            try:
                load_config(opts["config"], run_sets(shape, steps, Path("."), c.sets, opts["sets"]))
            except ConfigError as e:
                raise ValueError(f"case {c.name}: {e}; leave it out with --cases") from None


def _one_run(case: Case, steps: int, work: Path, opts: dict, st, warmup: int) -> dict:
    """One cluster run of `case`: counters around it, metrics from it."""
    from wanka.cluster import netns as nx

    run_dir = Path(tempfile.mkdtemp(prefix=f"{case.name}-{steps}-", dir=work))
    sets = run_sets(MEASURE_SHAPE, steps, run_dir, case.sets, opts["sets"])
    argv = train_argv(opts["config"], sets, opts["nproc_per_node"], opts["state_dir"])
    ifs = {n.name: n.veth_host for n in st.nodes}
    before = read_sent(ifs)
    try:
        with CounterSampler(ifs) as sampler:
            wall = run_train(argv, run_dir / "train.log", opts["timeout"](steps))
    except RunFailed:
        for n in st.nodes:  # ranks a killed launcher left behind must not skew the next run
            nx.kill_netns_pids(n.netns)
        raise
    sent = delta(read_sent(ifs), before)
    m = read_metrics(run_dir, warmup)
    return {"steps": steps, "sent": sent, "wall_s": wall, "step_time_s": m["step_time_s"],
            "tokens_per_s": m["tokens_per_s"], "val_loss": m["val_loss"], "run_dir": str(run_dir),
            "window_bytes_per_step": window_per_step(sampler.samples, m["logged_at"], warmup + 1,
                                                     steps)}  # fmt: skip


def measure_links(cases: list[Case], opts: dict) -> list[dict]:
    """Every case at every link rate; a case that fails is recorded and not run again."""
    from wanka.cluster import testbed

    n1, n2 = opts["steps"]
    sdir = tempfile.mkdtemp(prefix="wanka-bench-comm-")
    opts = {**opts, "state_dir": sdir}
    links = []
    try:
        for gbit in opts["gbits"]:
            st = testbed.up(opts["nodes"], gbit, sdir=sdir, **CLUSTER)
            testbed.wait_link(st)
            runs: dict[str, list[dict]] = {c.name: [] for c in cases}
            errors: dict[str, str] = {}
            # Cases interleaved within a repeat: a drift in machine load hits them all alike.
            for rep in range(opts["repeats"]):
                for c in cases:
                    for steps in (n1, n2):
                        if c.name in errors:
                            continue
                        print(f"  {gbit:g} Gbit/s  {c.name:14s} {steps:3d} steps  (repeat "
                              f"{rep + 1}/{opts['repeats']})", flush=True)  # fmt: skip
                        try:
                            r = _one_run(c, steps, opts["work"], opts, st, opts["warmup"])
                        except (RunFailed, OSError, ValueError) as e:
                            errors[c.name] = str(e)
                            print(f"    failed: {e}", flush=True)
                            continue
                        runs[c.name].append({**r, "repeat": rep})
            summaries = {c.name: report.summarise_case(runs[c.name], n1, n2, gbit, errors.get(c.name))
                         for c in cases}  # fmt: skip
            report.add_ratios(summaries)
            links.append({"gbit": gbit, "cases": summaries})
    finally:
        testbed.down(sdir)
        shutil.rmtree(sdir, ignore_errors=True)
    return links


def converge(cases: list[Case], opts: dict) -> dict:
    """Each case for N steps on this node; final validation loss vs the baseline's."""
    steps, world = opts["converge_steps"], opts["nodes"] * opts["nproc_per_node"]
    out: dict[str, dict] = {}
    t0 = time.time()
    for c in cases:
        print(f"  converge {c.name:14s} {steps} steps on {world} local ranks", flush=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"converge-{c.name}-", dir=opts["work"]))
        sets = run_sets(CONVERGE_SHAPE, steps, run_dir, c.sets, opts["sets"])
        try:
            wall = run_train(train_argv(opts["config"], sets, world, None), run_dir / "train.log",
                             opts["timeout"](steps))  # fmt: skip
            m = read_metrics(run_dir, opts["warmup"])
            out[c.name] = {"val_loss": m["val_loss"], "wall_s": wall,
                           "step_time_s": median(m["step_time_s"]), "run_dir": str(run_dir)}  # fmt: skip
        except (RunFailed, OSError, ValueError) as e:
            print(f"    failed: {e}", flush=True)
            out[c.name] = {"error": str(e)}
        out[c.name]["tolerance"] = c.val_tolerance
    report.add_convergence_diffs(out)
    return {"steps": steps, "ranks": world, "where": f"this node, {world} local ranks (no cluster)",
            "shape": CONVERGE_SHAPE, "cases": out, "wall_s": time.time() - t0}  # fmt: skip


def run_bench(cases: list[Case], opts: dict) -> dict:
    """The whole bench (opts: see bench_comm_main); returns the result document."""
    check_cases(cases, opts)
    if opts["gbits"]:
        from wanka.cluster.netns import missing_requirements

        why = missing_requirements()
        if why:
            raise ValueError(f"bench comm needs the cluster testbed: {why} (the convergence "
                             "check alone runs without it: --converge-steps N)")  # fmt: skip
    t0 = time.time()
    n1, n2 = opts["steps"]
    doc = {
        "bench": "comm", "date": datetime.date.today().isoformat(), "machine": _machine(),
        "command": "wanka " + shlex.join(opts["argv"]),
        "setup": {"nodes": opts["nodes"], "nproc_per_node": opts["nproc_per_node"],
                  "gbit": list(opts["gbits"]), "steps": [n1, n2], "warmup_steps": opts["warmup"],
                  "repeats": opts["repeats"], "config": opts["config"], "user_sets": opts["sets"],
                  "measure_shape": MEASURE_SHAPE, "cluster": CLUSTER},
        "method": report.METHOD,
        "cases": [{"name": c.name, "overrides": dict(c.overrides), "note": c.note} for c in cases],
    }  # fmt: skip
    if opts["gbits"]:
        doc["links"] = measure_links(cases, opts)
        doc["best"] = report.best(doc["links"])
    if opts["converge_steps"]:
        doc["convergence"] = converge(cases, opts)
    doc["wall_s"] = time.time() - t0
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    return doc


def write(doc: dict, out: Path) -> Path:
    write_out(out, json.dumps(doc, indent=1))
    md = out.with_suffix(".md") if out.suffix != ".md" else out.with_suffix(".table.md")
    write_out(md, report.markdown(doc) + "\n")
    return md


def bench_comm_main(cases: list[Case], opts: dict, out: Path, keep_runs: bool) -> int:
    """Run, print the table, write JSON + Markdown. Exit 1 when any case failed."""
    root = out.parent / (out.stem + "_runs")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=datetime.datetime.now().strftime("%Y%m%d-%H%M%S-"),
                                 dir=root))  # fmt: skip
    n1, n2 = opts["steps"]
    print(f"wanka bench comm: {len(cases)} cases ({', '.join(c.name for c in cases)}); "
          + (f"links {', '.join(f'{g:g}' for g in opts['gbits'])} Gbit/s, {opts['nodes']} nodes "
             f"x {opts['nproc_per_node']} ranks, runs of {n1} and {n2} steps x "
             f"{opts['repeats']}" if opts["gbits"] else "no link measurement")
          + (f"; convergence {opts['converge_steps']} steps" if opts["converge_steps"] else ""),
          flush=True)  # fmt: skip
    doc = run_bench(cases, {**opts, "work": work})
    md = write(doc, out)
    print(report.markdown(doc))
    failed = report.failures(doc)
    if not keep_runs and not failed:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} and {md} ({doc['wall_s'] / 60:.1f} min)"
          + (f"; run dirs kept in {work}" if keep_runs or failed else ""))  # fmt: skip
    for name, why in failed:
        print(f"wanka bench comm: case {name} failed: {why}")
    return 1 if failed else 0
