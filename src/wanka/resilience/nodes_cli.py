"""argparse wiring of `wanka nodes`: show the fault ledger, evict or clear a node by hand.
Every handler takes the parsed Namespace and returns an exit code; bad input raises
ValueError (one line, exit 2 in wanka.cli)."""

from __future__ import annotations

import argparse
import time

from wanka.resilience.ledger import FaultLedger

# Same as ResilienceConfig.ledger's default (src/wanka/config/schema.py).
DEFAULT_LEDGER = ".cache/wanka/faults.sqlite"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _open(a: argparse.Namespace) -> FaultLedger:
    # create=False: a mistyped --ledger must not silently show an empty new ledger.
    return FaultLedger(a.ledger, create=False)


def _table(a: argparse.Namespace) -> int:
    rows = _open(a).summary()
    if not rows:
        print(f"no faults recorded in {a.ledger}")
        return 0
    print(f"{'node':16s} {'status':8s} {'faults':>6s} {'counted':>7s}  {'last fault':19s}  "
          f"{'last cause':18s} by cause")  # fmt: skip
    for r in rows:
        causes = ", ".join(f"{c} {n}" for c, n in sorted(r["by_cause"].items())) or "-"
        print(f"{r['node']:16s} {r['status']:8s} {r['faults']:6d} {r['counted']:7d}  "
              f"{_when(r['last_time']):19s}  {r['last_cause'] or '-':18s} {causes}")  # fmt: skip
        if r["status"] == "evicted":
            print(f"{'':16s} evicted: {r['reason']}")
    return 0


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
    common.add_argument("--ledger", default=DEFAULT_LEDGER,
                        help=f"fault ledger file (default: {DEFAULT_LEDGER})")  # fmt: skip
    n = subparsers.add_parser("nodes", parents=[common],
                              help="fault ledger: node status, faults, evict / clear a node")  # fmt: skip
    # Bare `wanka nodes` shows the table, so the sub-command is optional.
    n.set_defaults(fn=_table)
    sub = n.add_subparsers(dest="nodes_cmd")
    # The sub-commands re-declare --ledger with SUPPRESS so that `wanka nodes --ledger X faults`
    # keeps X instead of being reset to the default by the sub-parser.
    sub_common = argparse.ArgumentParser(add_help=False)
    sub_common.add_argument("--ledger", default=argparse.SUPPRESS, help="fault ledger file")

    f = sub.add_parser("faults", parents=[sub_common], help="list recorded faults")
    f.add_argument("--node", default=None, help="only this node's faults")
    f.set_defaults(fn=_faults)
    c = sub.add_parser("clear", parents=[sub_common], help="put an evicted node back in service")
    c.add_argument("node")
    c.set_defaults(fn=_clear)
    e = sub.add_parser("evict", parents=[sub_common], help="evict a node by hand")
    e.add_argument("node")
    e.add_argument("--reason", required=True)
    e.set_defaults(fn=_evict)
