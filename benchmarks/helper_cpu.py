"""CPU used by each kind of process of a running supervised job, from /proc (Linux).

Start a job (e.g. `wanka train configs/demo.toml --cluster --nproc 1 --set train.steps=300`),
wait until it trains, then:

    python benchmarks/helper_cpu.py --seconds 60 [--out runs/bench/helper_cpu.json]

Each process's user+system time is read at the start and at the end of the window; the
difference over the window's wall time is its CPU share (100% = one core). Processes are
grouped by what they are, from the module their command line runs and their parents:
rank (a child of a node launcher: ranks fork from it), launcher (wanka.resilience.node_launch
with ranks), spare launcher (one waiting for its orders: no children), agent and spare agent
(wanka.control.agent, whose launcher has ranks or not), store (wanka.control.store_server),
supervisor (`wanka train|distill|rl|sft` itself), torchrun (torch.distributed.run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user+system seconds) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _snapshot() -> dict[int, tuple[int, float, list[str]]]:
    out = {}
    for p in Path("/proc").glob("[0-9]*"):
        st = _stat(int(p.name))
        if st is not None:
            out[int(p.name)] = (st[0], st[1], _cmdline(int(p.name)))
    return out


def _module(cmd: list[str]) -> str:
    """The module a python command line runs (`python -m MODULE ...`), or ""."""
    return cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else ""


def kind_of(pid: int, procs: dict[int, tuple[int, float, list[str]]]) -> str | None:
    """What a process is (None: not part of a wanka job)."""
    ppid, _, cmd = procs[pid]
    module = _module(cmd)
    parent = _module(procs[ppid][2]) if ppid in procs else ""
    if module == "wanka.resilience.node_launch":
        if parent == "wanka.resilience.node_launch":
            return "rank"
        children = [q for q, (pp, _, _) in procs.items() if pp == pid]
        return "launcher" if children else "spare launcher"
    if module == "wanka.control.agent":
        children = [q for q, (pp, _, _) in procs.items() if pp == pid]
        busy = any(_module(procs[q][2]) == "wanka.resilience.node_launch"
                   and any(pp == q for pp, _, _ in procs.values()) for q in children)  # fmt: skip
        return "agent" if busy else "spare agent"
    if module == "wanka.control.store_server":
        return "store"
    if module == "torch.distributed.run":
        return "torchrun"
    line = " ".join(cmd)
    if any(w in cmd for w in ("train", "distill", "rl", "sft")) and "wanka" in line:
        # The supervisor, or a rank spawned by torchrun (its parent is torchrun).
        return "rank" if parent == "torch.distributed.run" else "supervisor"
    return None


def measure(seconds: float) -> dict:
    t0, a = time.monotonic(), _snapshot()
    time.sleep(seconds)
    t1, b = time.monotonic(), _snapshot()
    wall = t1 - t0
    per_kind: dict[str, dict] = {}
    for pid, (_, cpu1, cmd) in b.items():
        if pid not in a or a[pid][2] != cmd:  # started in the window, or a reused pid
            continue
        kind = kind_of(pid, b)
        if kind is None:
            continue
        k = per_kind.setdefault(kind, {"processes": 0, "cpu_percent": 0.0})
        k["processes"] += 1
        k["cpu_percent"] += 100.0 * (cpu1 - a[pid][1]) / wall
    for k in per_kind.values():
        k["cpu_percent"] = round(k["cpu_percent"], 1)
    return {"window_s": round(wall, 2), "cores": os.cpu_count(), "kinds": per_kind}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    a = ap.parse_args()
    res = measure(a.seconds)
    print(f"{'kind':16s} {'processes':>9s} {'CPU % of one core':>18s}")
    for kind, k in sorted(res["kinds"].items(), key=lambda kv: -kv[1]["cpu_percent"]):
        print(f"{kind:16s} {k['processes']:9d} {k['cpu_percent']:18.1f}")
    print(f"window {res['window_s']} s, {res['cores']} cores")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
