"""`wanka bench cp` options. Apart from bench/cp.py so that building the CLI parser imports
neither torch nor numpy."""

from __future__ import annotations

import argparse


def _main(args: argparse.Namespace) -> int:
    from wanka.bench.cp import bench_cp_main

    return bench_cp_main(args)


def add_bench_cp_parser(sub) -> None:
    """Adds `cp` to the `wanka bench` subparsers `sub`."""
    p = sub.add_parser("cp", help="context-parallel layouts: step time, tokens/s, imbalance")
    p.add_argument("--quick", action="store_true", help="8k tokens per CP group only, 3 steps")
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="document lengths in tokens, one per line (default: the built-in "
                        "corpus's)")  # fmt: skip
    p.add_argument("--seq-len", default=None,
                   help="tokens per CP group, comma list (default 8192,16384,32768)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per layout (default 3 quick, 8 full; simulate 20)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=None, help="ranks (default dp x cp)")
    p.add_argument("--cp", type=int, default=None, help="CP degree (default 4; simulate 8)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel groups (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn rows and tokens")
    p.add_argument("--cost", default=None, metavar="JSON",
                   help="cost model from a measured run's JSON: dynamic plans with it (no "
                        "fit first); --simulate models with it")  # fmt: skip
    p.add_argument("--simulate", action="store_true",
                   help="no model: the modelled comparison at --ranks ranks")  # fmt: skip
    p.add_argument("--replay", action="store_true",
                   help="no spawned ranks: replay each rank's forward+backward alone, one "
                        "after another (compute without ranks sharing cores; no "
                        "communication)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None,
                   help="--replay: runs of each rank's share per step, fastest kept (default "
                        "3)")  # fmt: skip
    p.add_argument("--index-topk", type=int, default=None, metavar="K",
                   help="keys each query's sparse attention reads: the bench model's index_topk "
                        "(default 256; the production shape's is 2048); --simulate: the top-k "
                        "the cost model counts pairs up to (default the --cost file's)")  # fmt: skip
    p.add_argument("--ranks", default=None, help="simulate: rank counts (default 64,256,1024)")
    p.add_argument("--out", default=None,
                   help="JSON result; .md and .png beside it (default runs/bench/cp.json, "
                        "simulate runs/bench/cp_simulate.json)")  # fmt: skip
    p.set_defaults(fn=_main)
