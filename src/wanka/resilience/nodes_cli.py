"""argparse wiring of `wanka nodes`: show the fault ledger, evict or clear a node by hand, and
this node's in-memory snapshot folders; and of `wanka clean`, which removes the stale ones.
Every handler takes the parsed Namespace and returns an exit code; bad input raises
ValueError (one line, exit 2 in wanka.cli)."""

from __future__ import annotations

import argparse
import time

from wanka.resilience.ledger import FaultLedger

# Same as ResilienceConfig.ledger's and .snapshot_dir's defaults (src/wanka/config/schema.py).
DEFAULT_LEDGER = ".cache/wanka/faults.sqlite"
DEFAULT_SNAPSHOT_DIR = "/dev/shm/wanka"
SNAPSHOT_LINES = 8  # folders `wanka nodes` lists (`wanka clean` lists them all)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _open(a: argparse.Namespace) -> FaultLedger:
    # create=False: a mistyped --ledger must not silently show an empty new ledger.
    return FaultLedger(a.ledger, create=False)


def _table(a: argparse.Namespace) -> int:
    rows = _open(a).summary()
    if not rows:
        print(f"no faults recorded in {a.ledger}")
        _snapshot_section(a.snapshot_dir)
        return 0
    print(f"{'node':16s} {'status':8s} {'faults':>6s} {'counted':>7s}  {'last fault':19s}  "
          f"{'last cause':18s} by cause")  # fmt: skip
    for r in rows:
        causes = ", ".join(f"{c} {n}" for c, n in sorted(r["by_cause"].items())) or "-"
        print(f"{r['node']:16s} {r['status']:8s} {r['faults']:6d} {r['counted']:7d}  "
              f"{_when(r['last_time']):19s}  {r['last_cause'] or '-':18s} {causes}")  # fmt: skip
        if r["status"] == "evicted":
            print(f"{'':16s} evicted: {r['reason']}")
    print("faults: ranks that crashed, hung or ran slow; a NaN step skipped in place is "
          "not a node fault (see `wanka report RUN_DIR`); counted: toward eviction (injected "
          "faults and user errors never count)")  # fmt: skip
    _snapshot_section(a.snapshot_dir)
    return 0


def _max_age_h() -> float:
    from wanka.config.schema import ResilienceConfig

    return ResilienceConfig().snapshot_max_age_h


def _snapshot_section(snapshot_dir: str) -> None:
    """A short section: this node's snapshot folders and what `wanka clean` would free."""
    from wanka.train.run_lock import folder_lines, human_bytes, snapshot_folders

    folders, max_age = snapshot_folders(snapshot_dir), _max_age_h()
    print()
    if not folders:
        print(f"no in-memory snapshots in {snapshot_dir}")
        return
    stale = [f for f in folders if f.state(max_age) == "stale"]
    live = sum(f.live for f in folders)
    print(f"in-memory snapshots in {snapshot_dir}: {len(folders)} job folder(s), "
          f"{human_bytes(sum(f.bytes for f in folders))}; {live} live, {len(stale)} stale "
          f"(idle > {max_age:g} h)" + (f": `wanka clean --snapshots` frees "
                                      f"{human_bytes(sum(f.bytes for f in stale))}" if stale else ""))  # fmt: skip
    lines = folder_lines(folders, max_age)
    for line in lines[: SNAPSHOT_LINES + 1]:
        print("  " + line)
    if len(lines) > SNAPSHOT_LINES + 1:
        print(f"  ... {len(lines) - SNAPSHOT_LINES - 1} more: see `wanka clean`")


def _clean(a: argparse.Namespace) -> int:
    from wanka.config import load_config

    cfg = load_config(a.config, a.set).resilience
    root = a.snapshot_dir or cfg.snapshot_dir
    max_age = cfg.snapshot_max_age_h if a.max_age_h is None else a.max_age_h
    if not max_age > 0:  # (nan and -1 were taken as given; inf: never stale)
        where = "--max-age-h" if a.max_age_h is not None else "resilience.snapshot_max_age_h"
        raise ValueError(f"{where} {max_age} is not a positive number of hours")
    places = [(root, "")]
    if a.cluster or a.cluster_state:  # each node's own memory, as the host sees it
        from wanka.cluster.nodes import node_path
        from wanka.cluster.state import require

        for n in require(a.cluster_state).nodes:
            where = node_path(n, root)
            if where is not None:
                places.append((str(where), f"node {n.name}: "))
    rc = 0
    for where, label in places:
        rc |= _clean_one(a, where, label, max_age)
    return rc


def _clean_one(a: argparse.Namespace, root: str, label: str, max_age: float) -> int:
    """List, and with --snapshots/--all remove, the job folders under one snapshot root."""
    from wanka.train.run_lock import folder_lines, human_bytes, remove_folder, snapshot_folders

    folders = snapshot_folders(root)
    if not folders:
        print(f"{label}no in-memory snapshots in {root}")
        return 0
    print(f"{label}in-memory snapshots in {root} (stale: not live and idle > {max_age:g} h):")
    for line in folder_lines(folders, max_age):
        print("  " + line)
    if not (a.snapshots or a.all):
        print("`wanka clean --snapshots` removes the stale ones, `--all` every one not live")
        return 0
    doomed = [f for f in folders
              if f.state(max_age) == "stale" or (a.all and f.state(max_age) == "idle")]  # fmt: skip
    freed = [f for f in doomed if remove_folder(f)]
    for f in freed:
        print(f"removed {f.path} ({human_bytes(f.bytes)})")
    for f in doomed:
        if f not in freed:
            print(f"could not remove {f.path}")
    print(f"{label}freed {human_bytes(sum(f.bytes for f in freed))} in {len(freed)} folder(s)")
    return 0 if len(freed) == len(doomed) else 1


def _faults(a: argparse.Namespace) -> int:
    faults = _open(a).faults(node=a.node)
    if not faults:
        print(f"no faults recorded{f' for {a.node}' if a.node else ''} in {a.ledger}")
        return 0
    print(f"{'id':>5s}  {'time':19s}  {'node':16s} {'rank':>4s}  {'cause':18s} {'step':>7s}  "
          f"{'job':16s} detail")  # fmt: skip
    for f in faults:
        rank = "-" if f.rank is None else str(f.rank)
        step = "-" if f.step is None else str(f.step)
        print(f"{f.id:5d}  {_when(f.time):19s}  {f.node:16s} {rank:>4s}  {f.cause:18s} "
              f"{step:>7s}  {f.job:16s} {f.detail}")  # fmt: skip
    return 0


def _clear(a: argparse.Namespace) -> int:
    ledger = _open(a)
    if not ledger.known(a.node):
        raise ValueError(
            f"node {a.node!r} is not in the fault ledger {a.ledger}: see `wanka nodes`"
        )
    ledger.clear(a.node)
    print(f"{a.node}: cleared (back in service; its earlier faults no longer count)")
    return 0


def _evict(a: argparse.Namespace) -> int:
    if not a.reason.strip():
        raise ValueError("wanka nodes evict needs a non-empty --reason")
    _open(a).evict(a.node, a.reason)
    print(f"{a.node}: evicted ({a.reason}); `wanka nodes clear {a.node}` puts it back")
    return 0


def add_nodes_parser(subparsers: argparse._SubParsersAction) -> None:
    """`wanka nodes [faults|clear|evict] [--ledger PATH]`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--ledger", default=DEFAULT_LEDGER, help="fault ledger file")
    common.add_argument(
        "--snapshot-dir", default=DEFAULT_SNAPSHOT_DIR, help="in-memory snapshot dir"
    )
    n = subparsers.add_parser("nodes", parents=[common],
                              help="fault ledger: node status, faults, evict / clear a node")  # fmt: skip
    # Bare `wanka nodes` shows the table, so the sub-command is optional.
    n.set_defaults(fn=_table)
    sub = n.add_subparsers(dest="nodes_cmd")
    # The sub-commands re-declare --ledger with SUPPRESS so that `wanka nodes --ledger X faults`
    # keeps X instead of being reset to the default by the sub-parser.
    sub_common = argparse.ArgumentParser(add_help=False)
    sub_common.add_argument("--ledger", default=argparse.SUPPRESS, help="fault ledger file")
    sub_common.add_argument("--snapshot-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    f = sub.add_parser("faults", parents=[sub_common], help="list recorded faults")
    f.add_argument("--node", default=None, help="only this node's faults")
    f.set_defaults(fn=_faults)
    c = sub.add_parser("clear", parents=[sub_common], help="put an evicted node back in service")
    c.add_argument("node", help="node name as the ledger lists it")
    c.set_defaults(fn=_clear)
    e = sub.add_parser("evict", parents=[sub_common], help="evict a node by hand")
    e.add_argument("node", help="node name as the ledger lists it")
    e.add_argument("--reason", required=True, help="why, kept in the ledger")
    e.set_defaults(fn=_evict)


def add_clean_parser(subparsers: argparse._SubParsersAction) -> None:
    """`wanka clean [CONFIG] [--snapshots | --all]`: this node's in-memory snapshot folders."""
    c = subparsers.add_parser("clean", help="list / remove in-memory snapshots of jobs that are "
                              "not running (shared memory)")  # fmt: skip
    c.add_argument("config", nargs="?", help="TOML job file for resilience.snapshot_dir and "
                   "resilience.snapshot_max_age_h (defaults when omitted)")  # fmt: skip
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field")  # fmt: skip
    c.add_argument("--snapshot-dir", default=None, help="default: resilience.snapshot_dir")
    c.add_argument("--max-age-h", type=float, default=None,
                   help="stale after this many idle hours (default: "
                        "resilience.snapshot_max_age_h)")  # fmt: skip
    c.add_argument(
        "--cluster",
        action="store_true",
        help="also each cluster-in-a-box node's own memory (the default cluster)",
    )
    c.add_argument("--cluster-state", default=None, metavar="DIR",
                   help="also each node's own memory, of the cluster in DIR")  # fmt: skip
    what = c.add_mutually_exclusive_group()
    what.add_argument("--snapshots", action="store_true",
                      help="remove the stale folders (not live, idle over the age limit)")  # fmt: skip
    what.add_argument("--all", action="store_true", help="remove every folder not live")
    c.set_defaults(fn=_clean)
