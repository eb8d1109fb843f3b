"""argparse wiring for `wanka check CONFIG`: the pre-flight report, exit 0 when every check
passes (warnings allowed), 2 when the input is bad (the config cannot be read, or a static
check of the config and data fails), 1 when only a live check of the machines fails."""

from __future__ import annotations

import argparse
import os
import sys
import time

from wanka.distributed.launch import RDZV_FLAGS, rdzv_flag_type


def _nnodes(value: str | None) -> int:
    return int(str(value or 1).split(":")[-1])  # torchrun's MIN:MAX form: plan for MAX


def _check(a: argparse.Namespace) -> int:
    from wanka.config import ConfigError, load_config

    try:
        cfg = load_config(a.config, a.set)  # before torch is imported: a typo answers at once
    except (ConfigError, ValueError) as e:
        print(f"wanka check: {e}", file=sys.stderr)
        return 2
    from wanka.distributed.launch import inside_torchrun
    from wanka.resilience import preflight as pf

    live = a.live if a.live is not None else cfg.resilience.preflight == "full"
    if inside_torchrun():  # started per node by torchrun / `wanka cluster launch -- check ...`
        return _check_as_rank(cfg, live, a.timeout)
    if a.nproc is None:  # as `wanka train`: the smallest world the degrees fit
        a.nproc = cfg.parallel.smallest_world()
    if a.nproc < 1:
        print(f"wanka check: --nproc must be >= 1, got {a.nproc}", file=sys.stderr)
        return 2
    rdzv = {k: getattr(a, k) for k in RDZV_FLAGS if k != "max_restarts"}
    t0, nnodes = time.perf_counter(), _nnodes(a.nnodes)
    results = pf.static_checks(cfg, a.nproc * nnodes, nnodes)
    bad_input = [r.name for r in results if not r.ok]  # about the job's config and data
    if live:
        results += pf.live_checks(cfg, a.nproc, {**rdzv, "nnodes": rdzv.get("nnodes") or nnodes},
                                  a.timeout)  # fmt: skip
    report = pf.PreflightReport(results, time.perf_counter() - t0)
    print(report.format())
    if bad_input:  # the README's promise: bad input exits 2, with one line on stderr
        print(f"wanka check: the job's input failed {', '.join(bad_input)} (see the FAIL lines)",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0 if report.ok else 1  # 1: the machines, not the input


def _check_as_rank(cfg, live: bool, timeout_s: float) -> int:
    """This process is one rank of a launched job: rank 0 runs the static checks for the
    launched world, every rank runs the live checks, rank 0 prints the one report."""
    from wanka.resilience import preflight as pf

    t0 = time.perf_counter()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    nnodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # Live first, on every rank, so that backend start-up is not timed against rank 0's static
    # checks; live_rank leaves no process group behind, and the data check needs none.
    records = pf.live_rank(cfg.run.device, timeout_s) if live else None
    results = pf.static_checks(cfg, world, nnodes) if rank == 0 else []
    if records is not None and rank == 0:
        results += pf.collate(records, pf.memory_need_bytes(cfg, world))
    if rank != 0:
        return 0
    report = pf.PreflightReport(results, time.perf_counter() - t0)
    print(report.format())
    return 0 if report.ok else 1


def add_check_parser(subparsers: argparse._SubParsersAction) -> None:
    """`wanka check CONFIG [--set K=V ...] [--nproc N] [--nnodes ...] [--live/--no-live]`."""
    c = subparsers.add_parser("check", help="pre-flight: check a job's config and machines")
    c.add_argument("config", nargs="?", help="TOML job file (defaults when omitted)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field")  # fmt: skip
    c.add_argument("--nproc", type=int, default=None,
                   help="ranks per node the job will use (default: as `wanka train`, the "
                   "fewest the [parallel] degrees fit)")  # fmt: skip
    c.add_argument("--live", action=argparse.BooleanOptionalAction, default=None,
                   help="also start the ranks: backend, links, burn-in, free memory (default: "
                        "resilience.preflight='full')")  # fmt: skip
    c.add_argument("--timeout", type=float, default=60.0, help="live checks: seconds per wait")
    for flag in RDZV_FLAGS:
        if flag != "max_restarts":
            c.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None, type=rdzv_flag_type(flag),
                           help="as for torchrun (multi-node live checks)")  # fmt: skip
    # wanka.cli dispatches on `fn`; `func` is the argparse-docs name other callers may use.
    c.set_defaults(fn=_check, func=_check)
