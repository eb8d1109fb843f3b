"""`wanka chaos drill`: run a fault schedule against wanka and the torchrun baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wanka.resilience.drill import DEFAULT_SCHEDULE


def _drill(a: argparse.Namespace) -> int:
    from wanka.resilience.drill import drill, format_drill

    if a.cluster_state and not a.cluster:
        raise ValueError(
            "--cluster-state needs --cluster (run the drill across the cluster's nodes)"
        )
    if a.nproc < 1:  # (each of the drill's runs failed with its reason hidden)
        raise ValueError(f"--nproc must be 1 or more (got {a.nproc}): the ranks of each run")
    out = Path(a.out)
    result = drill(a.config, a.set, a.nproc, a.schedule, out, baseline=not a.no_baseline,
                   operator_timeout_s=a.operator_timeout,
                   reference=Path(a.reference) if a.reference else None,
                   wanka=not a.baseline_only, ckpt_fs_mb=a.ckpt_fs_mb,
                   cluster_state=(a.cluster_state or "") if a.cluster else None)  # fmt: skip
    print(format_drill(result))
    print(f"\nfull results: {out / 'drill.json'}")
    run = result["runs"].get("wanka") or result["runs"]["baseline"]
    return 0 if run["rc"] == 0 and (run["state_equal"] or "wanka" not in result["runs"]) else 1


def _show(a: argparse.Namespace) -> int:
    from wanka.resilience.drill import format_drill

    path = Path(a.out) / "drill.json"
    if not path.is_file():
        raise ValueError(f"no drill results at {path}: run `wanka chaos drill --out {a.out}` first")
    print(format_drill(json.loads(path.read_text())))
    return 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of MiB (e.g. 128)")
    return n


def add_chaos_parser(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser("chaos", help="fault drills: inject faults, measure recovery")
    sub = c.add_subparsers(dest="chaos_cmd", required=True)
    d = sub.add_parser("drill", help="reference, wanka and torchrun-baseline runs of one schedule")
    d.add_argument("config", nargs="?", help="TOML job file (defaults when omitted)")
    d.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    d.add_argument("--nproc", type=int, default=2, help="ranks per run")
    d.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                   help="faults, e.g. 'kill@step=8,rank=1;stop@step=16' (kinds in docs/RESILIENCE.md)")  # fmt: skip
    d.add_argument(
        "--out", default="runs/drill", help="directory for the three runs and drill.json"
    )
    d.add_argument("--no-baseline", action="store_true", help="skip the torchrun baseline")
    d.add_argument("--baseline-only", action="store_true", help="only the torchrun baseline")
    d.add_argument("--reference", default=None,
                   help="a finished fault-free run of the same config, instead of running one")  # fmt: skip
    d.add_argument("--operator-timeout", type=float, default=60.0,
                   help="baseline: seconds without progress before the job is killed and resubmitted")  # fmt: skip
    d.add_argument("--ckpt-fs-mb", type=_positive_int, default=None, metavar="MIB",
                   help="put each run's checkpoints on a tmpfs of this size (root on Linux; "
                        "unmounted after the run, its checkpoints with it), for disk_full faults")  # fmt: skip
    d.add_argument("--cluster", action="store_true",
                   help="run every job across the nodes of `wanka cluster up` (--nproc ranks per "
                        "node); node_kill takes the whole node, link_cut@...,node=N,for=S works")  # fmt: skip
    d.add_argument(
        "--cluster-state", default=None, help="cluster state dir (default: the testbed's)"
    )
    d.set_defaults(fn=_drill)
    s = sub.add_parser("show", help="print the tables of a finished drill")
    s.add_argument("--out", default="runs/drill", help="the drill's --out folder")
    s.set_defaults(fn=_show)
