"""One node's launcher for one attempt of a supervised cluster job, started before it is needed.

torchrun starts every rank as a new interpreter that imports torch and wanka (3-4 s on a busy
host), after torchrun's own start (~2 s): a restart pays both before its first step. This
launcher imports the trainer once and then waits for its attempt's orders, one JSON line on
stdin; with them it runs torch's elastic agent in-process (torchrun's own options: its
static rendezvous, the same environment for the ranks) and forks the ranks from itself, as the
single-node supervisor does. The supervisor starts the next attempt's launcher on every node
while an attempt runs (resilience/cluster_attempt.py), so a restart finds the imports done.

    python -m wanka.resilience.node_launch
    stdin: {"torchrun": [torchrun options], "argv": [wanka CLI args], "env": {...},
            "start_method": "fork" | "spawn"}

Closing stdin without orders ends it (exit 0): the job needed no further attempt. Exit codes
are torchrun's: 0 when every rank succeeded, 1 when one failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# Handled by the elastic agent while it runs, as torchrun does: SIGTERM reaches the ranks.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
BAD_ORDERS = 70  # EX_SOFTWARE: not the ranks' 2 (an input error) nor 75 (stopped on request)


def read_orders(stream) -> dict | None:
    """The attempt's orders, or None when stdin closed without them."""
    line = stream.readline()
    if not line.strip():
        return None
    orders = json.loads(line)
    for key in ("torchrun", "argv", "env"):
        if key not in orders:
            raise ValueError(f"node launcher: orders without {key!r}")
    return orders


def launch(orders: dict) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from wanka.distributed.launch import quiet_launcher_logs
    from wanka.resilience.supervisor import _worker_entry

    os.environ.update(orders["env"])
    os.environ["WANKA_ORDERS_TIME"] = repr(time.time())  # start-up parts (trainer.py)
    quiet_launcher_logs()
    config, _, _ = config_from_args(parse_args([*orders["torchrun"], "x"]))
    # Fork is the point (the imports are done); CUDA/NPU state does not survive a fork, so
    # the supervisor asks accelerator jobs to spawn.
    config.start_method = orders.get("start_method", "fork")
    config.max_restarts = 0  # restarts are the supervisor's
    config.monitor_interval = 0.05
    config.signals_to_handle = SIGNALS
    config.shutdown_timeout = 60  # room for the last-gasp checkpoint
    try:
        elastic_launch(config, _worker_entry)(orders["argv"], orders["env"])
    except ChildFailedError:
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def main() -> int:
    import wanka.train.trainer  # noqa: F401  (imported once, inherited by every forked rank)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # while waiting
    try:
        orders = read_orders(sys.stdin)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"wanka node launcher: {e}", file=sys.stderr)
        return BAD_ORDERS
    if orders is None:
        return 0
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the elastic agent installs its own
    return launch(orders)


if __name__ == "__main__":
    from wanka.process_exit import exit_now

    exit_now(main())  # the job's end and a restart wait for this launcher to be gone
