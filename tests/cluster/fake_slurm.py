"""Stand-ins for Slurm's `srun`, `scontrol` and `scancel`, enough to run the sbatch scripts of
`wanka launch --slurm` with plain bash (no slurmctld, no sbatch).

    python fake_slurm.py install BIN_DIR    # BIN_DIR/srun, scontrol, scancel -> this file

Configuration, from the environment:
  FAKE_SLURM_DIR    state: the running steps' task PIDs, the requeue log (`requeued`)
  FAKE_SLURM_NODES  JSON list, one entry per allocated node, in SLURM_JOB_NODELIST's order:
                    {"host": "n0"} runs that node's task here (a local stand-in), and
                    {"host": "n0", "netns": "wanka-x-n0", "hosts": "/path/hosts"} runs it in
                    the network namespace, in its own UTS and mount namespaces with hostname
                    `host` and `hosts` bind-mounted on /etc/hosts: a node whose hostname
                    resolves to its own address, as on a real cluster; with
                    "shm": "/path" too, that folder is the node's own /dev/shm.

What each does, as the real one does (and only that):
  srun [--nodes=N] [--ntasks=N] [--ntasks-per-node=1] [--kill-on-bad-exit[=0|1]] [--wait=S]
       [--no-kill] CMD
      one task per node with SLURM_JOB_ID, SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID,
      SLURM_NNODES, SLURM_NTASKS, SLURM_STEP_ID and SLURMD_NODENAME; exit code = the highest
      task exit code (128 + signal for a task killed by one). A TERM, HUP or QUIT to srun
      itself kills the tasks with SIGKILL ("forcing job termination"); USR1, USR2 and CONT are
      forwarded to them. The remaining tasks get TERM, then KILL after KILL_WAIT_S (Slurm's
      KillWait): with --kill-on-bad-exit, as soon as a task exits non-zero; with --wait=S, S
      seconds after the first task ended, whatever its exit code (0: no limit); neither with
      --no-kill.
  scontrol show hostnames [LIST]   expand a host list (default $SLURM_JOB_NODELIST)
  scontrol requeue JOBID           append JOBID to $FAKE_SLURM_DIR/requeued
  scancel --signal=SIG JOBID       SIG to every process of the job's steps (not the batch
                                   shell), as slurmstepd signals a step's whole cgroup
Anything else exits 1 naming what is not supported, so a script that relies on more fails."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

KILL_WAIT_S = 15.0
# Inside a node: its own hostname and /etc/hosts, then the task's command.
NODE_SHELL = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
SHM_SHELL = 'mount --bind "$1" /dev/shm && shift && exec "$@"'


def fail(msg: str) -> None:
    print(f"fake slurm: {msg}", file=sys.stderr)
    sys.exit(1)


def expand_hostlist(text: str) -> list[str]:
    """'n[0-2,5],gpu01' -> ['n0', 'n1', 'n2', 'n5', 'gpu01'] (zero padding kept)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def state_dir() -> Path:
    d = Path(os.environ.get("FAKE_SLURM_DIR") or fail("FAKE_SLURM_DIR is not set"))
    (d / "steps").mkdir(parents=True, exist_ok=True)
    return d


def descendants(roots: list[int]) -> list[int]:
    """The roots and every process below them (a step's processes, whatever their session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid, ppid = int(stat.parent.name), int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def signal_tree(roots: list[int], sig: int) -> None:
    for pid in descendants(roots):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def srun(argv: list[str]) -> int:
    opts: dict[str, str] = {}
    while argv and argv[0].startswith("-"):
        name, _, value = argv.pop(0).partition("=")
        if name not in ("--nodes", "--ntasks", "--ntasks-per-node", "--kill-on-bad-exit", "--wait",
                        "--no-kill"):  # fmt: skip
            fail(f"srun option {name} is not supported")
        opts[name] = value or "1"
    if not argv:
        fail("srun: no command")
    nodes = json.loads(os.environ.get("FAKE_SLURM_NODES") or fail("FAKE_SLURM_NODES is not set"))
    n = int(opts.get("--nodes", len(nodes)))
    if opts.get("--ntasks-per-node", "1") != "1" or int(opts.get("--ntasks", n)) != n:
        fail("srun: only one task per node is supported")
    if n > len(nodes):
        fail(f"srun: {n} nodes requested, {len(nodes)} allocated")
    job = os.environ.get("SLURM_JOB_ID") or fail("SLURM_JOB_ID is not set")
    procs = []
    for i, node in enumerate(nodes[:n]):
        env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0",
                   SLURM_NNODES=str(n), SLURM_NTASKS=str(n), SLURM_STEP_ID="0",
                   SLURMD_NODENAME=node["host"])  # fmt: skip
        cmd = list(argv)
        if "shm" in node:  # inside the mount namespace below: only this task sees it
            cmd = ["sh", "-c", SHM_SHELL, "fake-shm", node["shm"], *cmd]
        if "netns" in node:
            cmd = ["ip", "netns", "exec", node["netns"], "unshare", "--uts", "--mount", "--",
                   "sh", "-c", NODE_SHELL, "fake-slurmstepd", node["hosts"], node["host"], *cmd]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    step = state_dir() / "steps" / f"{job}.{os.getpid()}"
    step.write_text("\n".join(str(p.pid) for p in procs))
    roots = [p.pid for p in procs]

    def on_signal(sig: int, _frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            print("srun: forcing job termination", file=sys.stderr, flush=True)
            signal_tree(roots, signal.SIGKILL)
        else:
            signal_tree(roots, sig)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGCONT):  # fmt: skip
        signal.signal(sig, on_signal)
    # --no-kill: "--kill-on-bad-exit and --wait have no effect upon the job step" (srun(1))
    no_kill = "--no-kill" in opts
    wait_s = 0.0 if no_kill else float(opts.get("--wait", "0"))
    first_end = kill_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            ended = [p for p in procs if p.returncode is not None]
            if ended and first_end is None:
                first_end = now
            bad = [p for p in ended if p.returncode != 0]
            if kill_at is None and (
                (bad and opts.get("--kill-on-bad-exit", "0") == "1" and not no_kill)
                or (wait_s > 0 and first_end is not None and now - first_end > wait_s)
            ):
                print(f"srun: error: terminating the step (task {procs.index(ended[0])} exited "
                      f"with exit code {ended[0].returncode})", file=sys.stderr, flush=True)  # fmt: skip
                signal_tree([p.pid for p in procs if p.poll() is None], signal.SIGTERM)
                kill_at = now + KILL_WAIT_S
            if kill_at is not None and now > kill_at:
                signal_tree([p.pid for p in procs if p.poll() is None], signal.SIGKILL)
            time.sleep(0.05)
    finally:
        step.unlink(missing_ok=True)
    for i, p in enumerate(procs):  # as srun reports them
        if p.returncode > 0:
            print(f"srun: error: {nodes[i]['host']}: task {i}: Exited with exit code "
                  f"{p.returncode}", file=sys.stderr)  # fmt: skip
        elif p.returncode < 0:
            print(f"srun: error: {nodes[i]['host']}: task {i}: "
                  f"{signal.Signals(-p.returncode).name}", file=sys.stderr)  # fmt: skip
    return max(p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs)


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        text = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand_hostlist(text)))
        return 0
    if argv[:1] == ["requeue"] and len(argv) == 2:
        with open(state_dir() / "requeued", "a") as f:
            f.write(argv[1] + "\n")
        return 0
    fail(f"scontrol {' '.join(argv)} is not supported")
    return 1


def scancel(argv: list[str]) -> int:
    sig, jobs = None, []
    while argv:
        a = argv.pop(0)
        if a.startswith("--signal="):
            sig = a.split("=", 1)[1]
        elif a == "-s" and argv:
            sig = argv.pop(0)
        elif re.fullmatch(r"\d+", a):
            jobs.append(a)
        else:
            fail(f"scancel {a} is not supported")
    if sig is None or not jobs:
        fail("only `scancel --signal=SIG JOBID` is supported")
    num = int(sig) if sig.isdigit() else signal.Signals["SIG" + sig.removeprefix("SIG")].value
    for job in jobs:
        for step in (state_dir() / "steps").glob(f"{job}.*"):
            signal_tree([int(x) for x in step.read_text().split()], num)
    return 0


def install(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("srun", "scontrol", "scancel"):
        path = bin_dir / tool
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" '
                        f'{tool} "$@"\n')  # fmt: skip
        path.chmod(0o755)


def main() -> int:
    signal.signal(
        signal.SIGPIPE, signal.SIG_DFL
    )  # `scontrol ... | head -n 1`: end quietly, as C does
    tool, argv = sys.argv[1], sys.argv[2:]
    if tool == "install":
        install(Path(argv[0]))
        return 0
    return {"srun": srun, "scontrol": scontrol, "scancel": scancel}[tool](argv)


if __name__ == "__main__":
    sys.exit(main())
