"""`wanka bench comm` options. Apart from bench/comm.py so that building the CLI parser imports
no torch; every flag is judged here, before a cluster or rank starts."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from wanka.bench.comm_cases import DEFAULT_CASES, KNOWN, parse_gbit, parse_steps, select_cases

NODES = 2  # the HSDP cases put one replica on each of 2 nodes
STEPS, QUICK_STEPS = "4,12", "3,6"


def _positive(value: int, flag: str, least: int = 1) -> int:
    if value < least:
        raise ValueError(f"{flag} must be {least} or more, got {value}")
    return value


def _main(a: argparse.Namespace) -> int:
    from wanka.bench import comm_report

    if a.table:  # print the tables of an earlier result: no run
        path = Path(a.table)
        if not path.is_file():
            raise FileNotFoundError(f"--table {path}: no such file")
        print(comm_report.markdown(json.loads(path.read_text())))
        return 0
    cases = select_cases(a.cases, a.case)
    converge = _positive(a.converge_steps, "--converge-steps", 0)
    # --converge-steps alone is the convergence check alone; --gbit adds the link measurement.
    gbit_text = a.gbit if a.gbit is not None else ("" if converge else "1,10")
    gbits = parse_gbit(gbit_text) if gbit_text.strip().lower() not in ("", "none") else ()
    if not gbits and not converge:
        raise ValueError("--gbit none and no --converge-steps: nothing to measure")
    steps = parse_steps(a.steps or (QUICK_STEPS if a.quick else STEPS))
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if not 0 <= warmup < steps[0]:
        raise ValueError(f"--warmup {warmup} must be 0 or more and below N1={steps[0]} of --steps")
    if converge and converge <= warmup:
        raise ValueError(f"--converge-steps {converge} must exceed the {warmup} warm-up steps")
    opts = {
        "gbits": gbits, "steps": steps, "warmup": warmup, "nodes": NODES,
        "repeats": _positive(a.repeats, "--repeats"),
        "nproc_per_node": _positive(a.nproc_per_node, "--nproc-per-node"),
        "converge_steps": converge, "config": a.config, "sets": list(a.set),
        "argv": list(getattr(a, "argv", None) or ["bench", "comm"]),
        "timeout": lambda n: 240 + 20 * n,  # start-up (about 30 s on 2 cores) + slow steps
    }  # fmt: skip
    if a.config and not Path(a.config).is_file():
        raise FileNotFoundError(f"--config {a.config}: no such file")
    cores = os.cpu_count() or 1
    if opts["nproc_per_node"] > cores:  # gloo ranks on this machine's cores; 200000 of them
        # (no pre-flight in the bench's runs) filled the memory
        raise ValueError(f"--nproc-per-node {opts['nproc_per_node']}: this machine has {cores} "
                         "core(s), and each node's ranks run on them: use at most that")  # fmt: skip
    out = Path(a.out or ("runs/bench/comm.json" if gbits else "runs/bench/comm_converge.json"))
    from wanka.bench.comm import bench_comm_main
    from wanka.bench.output import check_out, sigterm_as_exit

    check_out(out)  # before the runs, not after them
    with sigterm_as_exit():  # the testbed comes down on SIGTERM too
        return bench_comm_main(cases, opts, out, a.keep_runs)


def add_bench_comm_parser(sub) -> None:
    """Adds `comm` to the `wanka bench` subparsers `sub`."""
    p = sub.add_parser("comm", help="gradient communication on the cluster-in-a-box: inter-node "
                       "bytes/step, step time, tokens/s; convergence vs uncompressed")  # fmt: skip
    p.add_argument("--cases", default=None,
                   help=f"comma list of {', '.join(KNOWN)} (default {','.join(DEFAULT_CASES)}); "
                        "flat_fp32, the baseline of every ratio, always runs")  # fmt: skip
    p.add_argument("--case", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="add a case of your own, e.g. a combination of options (repeatable)")  # fmt: skip
    p.add_argument("--gbit", default=None,
                   help="inter-node link rates in Gbit/s, each measured in turn (default 1,10; "
                        "none, the default when --converge-steps is given: no cluster)")  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks on each of the 2 nodes")
    p.add_argument("--steps", default=None, metavar="N1,N2",
                   help=f"the two run lengths whose bytes are differenced (default {STEPS}, "
                        f"--quick {QUICK_STEPS})")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps of each run left out of step time (default 2, --quick 1)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="(N1, N2) pairs per case and link: run-to-run variation")  # fmt: skip
    p.add_argument("--converge-steps", type=int, default=0, metavar="N",
                   help="also train each case N steps on this node and compare final "
                        "validation losses (e.g. 200)")  # fmt: skip
    p.add_argument("--config", default=None, help="base TOML job (default: built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (beats the bench's own)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="shorter runs (steps 3,6, warm-up 1)")
    p.add_argument("--out", default=None,
                   help="JSON result, .md beside it (default runs/bench/comm.json; "
                        "runs/bench/comm_converge.json for the convergence check alone)")  # fmt: skip
    p.add_argument("--keep-runs", action="store_true",
                   help="keep every run's directory (logs, metrics); kept anyway on a failure")  # fmt: skip
    p.add_argument("--table", default=None, metavar="JSON",
                   help="print the Markdown table of an earlier result and exit")  # fmt: skip
    p.set_defaults(fn=_main)
