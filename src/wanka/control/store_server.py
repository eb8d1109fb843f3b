"""The control store as a process of its own, on one node: its host is that node, and the store
dies with it (a node kill, a lost host), as torchrun's c10d rendezvous store dies with the agent
that hosts it. The supervisor starts it inside the node and learns its port from one line:

    python -m wanka.control.store_server --host ADDR [--port 0]
    -> {"port": N}            (stdout, once serving)

It serves until its stdin closes (the supervisor that started it is done or gone) or it is
killed (SIGKILL: SIGINT, SIGTERM and SIGHUP are for the job's ranks, not for it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wanka.control.store_server", description=__doc__)
    p.add_argument("--host", required=True, help="this node's address")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    a = p.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a job's stop is not the store's
        signal.signal(sig, signal.SIG_IGN)
    from wanka.control.store import ControlStore

    try:
        store = ControlStore.serve(a.host, a.port, "server")
    except ConnectionError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps({"port": store.port}), flush=True)
    sys.stdin.read()  # EOF: whoever started us is gone; the store goes with us
    return 0


if __name__ == "__main__":
    from wanka.process_exit import exit_now

    exit_now(main())
