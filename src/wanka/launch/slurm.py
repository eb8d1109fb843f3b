"""`wanka launch --slurm`: an sbatch script that runs one `wanka train` per node under srun, all
meeting at a c10d rendezvous hosted on the allocation's first node.

Stop requests: Slurm sends USR1 to the batch shell `warn_s` seconds before the time limit
(`--signal=B:USR1@...`); preemption and `scancel` send TERM. The script turns either into
`scancel --signal=TERM JOB`, which reaches every process of the training step (not srun itself:
srun turns a TERM of its own into SIGKILL of its tasks). Each rank then stops at the next step
boundary together with the others, writes a last-gasp checkpoint and exits 75 (EX_TEMPFAIL).
After a time-limit stop the script requeues the job; after preemption Slurm does (`--requeue`).
A requeued run is the same `wanka train`, which resumes from the newest checkpoint in run.dir."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from wanka.launch import Job

EXIT_PREEMPTED = 75  # wanka train after a last-gasp checkpoint (resilience/supervisor.py)
MAX_SIGNAL_S = 65535  # the largest lead time `--signal` accepts
STEP_WAIT_S = 120  # srun --wait: how long the other nodes may run on once one node has ended
# Values that go into `#SBATCH` lines verbatim: sbatch ends an option at whitespace.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,@%+=/-]+$")


@dataclass
class SlurmResources:
    gpus_per_node: int = 0
    gres: str | None = None  # e.g. "npu": `--gres=npu:G` instead of `--gpus-per-node=G`
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # Slurm time limit as given; checked by parse_time
    warn_s: int = 300  # the time-limit warning comes this many seconds early
    rdzv_port: int = 29500


def parse_time(text: str) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m or text.strip() != text:
        raise ValueError(f"--time {text!r}: use HH:MM:SS (or MM, MM:SS, D-HH, D-HH:MM, "
                         "D-HH:MM:SS), e.g. --time 04:00:00")  # fmt: skip
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(a), int(b or 0), int(c or 0)]
        seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
        fields = parts[1:]
    elif c is not None:  # HH:MM:SS
        seconds, fields = int(a) * 3600 + int(b) * 60 + int(c), [int(b), int(c)]
    elif b is not None:  # MM:SS
        seconds, fields = int(a) * 60 + int(b), [int(b)]
    else:  # MM
        seconds, fields = int(a) * 60, []
    if any(f >= 60 for f in fields) or seconds == 0:
        raise ValueError(f"--time {text!r}: minutes and seconds must be below 60 and the "
                         "limit above 0")  # fmt: skip
    return seconds


def check_resources(res: SlurmResources) -> None:
    """One-line errors for what sbatch would reject (or misread) later."""
    if res.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be 0 or more (got {res.gpus_per_node})")
    if res.cpus_per_task is not None and res.cpus_per_task < 1:
        raise ValueError(f"--cpus-per-task must be 1 or more (got {res.cpus_per_task})")
    for flag, value in (("--partition", res.partition), ("--account", res.account),
                        ("--gres", res.gres)):  # fmt: skip
        if value is not None and not _SBATCH_VALUE.match(value):
            raise ValueError(f"{flag} {value!r}: no spaces, quotes or '#' (sbatch reads the "
                             "value up to the first space)")  # fmt: skip
    if not 0 < res.warn_s <= MAX_SIGNAL_S:
        raise ValueError(f"--warn-seconds must be 1-{MAX_SIGNAL_S} (got {res.warn_s})")
    if res.time is not None and res.warn_s >= parse_time(res.time):
        raise ValueError(f"--warn-seconds {res.warn_s} is not shorter than --time {res.time}: "
                         "the warning would come before the job starts")  # fmt: skip
    if not 0 < res.rdzv_port < 65535:  # the control store takes the next port
        raise ValueError(f"--rdzv-port must be 1-65534 (got {res.rdzv_port})")


def check_chdir(chdir: str) -> None:
    if not _SBATCH_VALUE.match(chdir):
        raise ValueError(f"cannot run the job in {chdir!r} (sbatch's --chdir takes no spaces "
                         "or quotes): run wanka launch from another directory")  # fmt: skip


def _directives(job: Job, res: SlurmResources, chdir: str) -> list[str]:
    """`#SBATCH` lines, each after a comment saying what it is for."""
    out = ["# One task per node: its `wanka train` starts the node's ranks and supervises them.",
           f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={job.nodes}",
           "#SBATCH --ntasks-per-node=1"]  # fmt: skip
    if res.gpus_per_node:
        out.append("# Accelerators per node.")
        out.append(f"#SBATCH --gres={res.gres}:{res.gpus_per_node}" if res.gres
                   else f"#SBATCH --gpus-per-node={res.gpus_per_node}")  # fmt: skip
    if res.cpus_per_task:
        out.append(f"#SBATCH --cpus-per-task={res.cpus_per_task}")
    for flag, value in (("partition", res.partition), ("account", res.account),
                        ("time", res.time)):  # fmt: skip
        if value:
            out.append(f"#SBATCH --{flag}={value}")
    out += [
        f"# USR1 to this script {res.warn_s} s before the time limit: the ranks stop together,",
        "# write a last-gasp checkpoint, and the job is requeued to resume from it.",
        f"#SBATCH --signal=B:USR1@{res.warn_s}",
        "# Preemption or a node failure puts the job back in the queue (same job id; with",
        "# resilience.control = store, only a failure of the first node, below).",
        "#SBATCH --requeue",
        "# A requeued run appends to the job's output file instead of truncating it.",
        "#SBATCH --open-mode=append",
    ]
    if job.store_control:
        out += ["# The job outlives a failed node (not the first: the batch script runs there):",
                "# the coordinator puts a hot spare in its place or goes on without it.",
                "#SBATCH --no-kill"]  # fmt: skip
    if job.evicted:
        reasons = "; ".join(f"{n}: {r}" for n, r in sorted(job.evicted.items()))
        out.append(f"# Evicted in the fault ledger {job.ledger} ({reasons})".replace("\n", " "))
        out.append(f"#SBATCH --exclude={','.join(sorted(job.evicted))}")
    check_chdir(chdir)
    out.append(f"#SBATCH --chdir={chdir}")
    return out


def render(job: Job, res: SlurmResources, wanka: list[str], chdir: str, how: str = "") -> str:
    """The sbatch script. `wanka` runs wanka on the nodes (e.g. [python, -m, wanka.cli]);
    `chdir` is where the job runs (relative paths in the config are relative to it); `how` is
    the command line that wrote the script, recorded in its header."""
    check_resources(res)
    q = shlex.quote
    train = " ".join(q(a) for a in [*wanka, *job.train_args()])
    port = res.rdzv_port
    rc_setup = rc_read = ""
    if job.store_control:
        rc_file = (
            shlex.quote(f"{job.run_dir}/resilience/")
            + '"job-rc.$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"'
        )
        rc_setup = (
            "# The coordinator writes the job's exit code here: srun's is the highest task's, and a\n"
            "# host lost on the way (its task killed) would hide a finished job or a last gasp.\n"
            f"export WANKA_JOB_RC_FILE={rc_file}\n"
            'rm -f "$WANKA_JOB_RC_FILE"\n'
        )
        rc_read = (
            'if [ -s "$WANKA_JOB_RC_FILE" ]; then\n'
            '  rc=$(cat "$WANKA_JOB_RC_FILE")\n'
            '  rm -f "$WANKA_JOB_RC_FILE"\n'
            "fi\n"
        )
        step_policy = "--no-kill --kill-on-bad-exit=0"
        step_comment = (
            "# --no-kill: a node that fails or a task that ends does not end the step: the\n"
            "# coordinator decides (a hot spare takes the node's place, or the job goes on without\n"
            "# it) and ends every host's task itself. --kill-on-bad-exit=0, explicitly (a site\n"
            "# may default it on).\n"
        )
    else:
        step_policy = f"--wait={STEP_WAIT_S} --kill-on-bad-exit=0"
        step_comment = (
            f"# --wait: once one node's `wanka train` has ended, the others get {STEP_WAIT_S} s to end\n"
            "# too (all end within seconds of each other after a last gasp; the peers of a failed\n"
            "# node are stopped then). --kill-on-bad-exit=0, explicitly (a site may default it on):\n"
            "# the first node to exit 75 would get its peers killed in the middle of their own exit.\n"
        )
    head = [
        "#!/bin/bash",
        f"# {job.nodes} node(s) x {job.nproc} rank(s) of `wanka train`.",
        *([f"# Written by: {how}".replace("\n", " ")] if how else []),
        "# Submit with `sbatch FILE`; docs/LAUNCH.md explains each line.",
        *_directives(job, res, chdir),
    ]
    body = f"""
set -u
# The rendezvous host: the allocation's first node (its agent hosts the c10d store).
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "wanka: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST," \\
  "rendezvous at $head:{port}" >&2

# A stop request (USR1 before the time limit; TERM on preemption or scancel) becomes TERM to
# every process of the training step. Never to srun itself: srun answers its own TERM with
# SIGKILL to the tasks, which would lose the last-gasp checkpoint.
stop=
interrupted=
request_stop() {{
  interrupted=1
  [ -n "$stop" ] && return
  stop=$1
  echo "wanka: $1: the ranks stop at the next step and write a checkpoint" >&2
  scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap 'request_stop time-limit' USR1
trap 'request_stop preempted' TERM

# With resilience.control = "store", the supervisor on $head coordinates the others through a
# control store on port {port + 1}: it names each fault with its node and decides the restarts.
# WANKA_NODE: the fault ledger names nodes as Slurm does, so `--exclude` can use them later.
# The rendezvous id changes with each requeue: a run never mistakes the run-directory lock of
# an earlier run of this job (killed before it could release it) for a peer's.
{step_comment}{rc_setup}srun --nodes={job.nodes} --ntasks={job.nodes} --ntasks-per-node=1 {step_policy} \\
  bash -c 'export WANKA_NODE="$SLURMD_NODENAME"; exec "$@"' wanka-task \\
  {train} \\
  --nnodes {job.nodes} --rdzv-backend c10d --rdzv-endpoint "$head:{port}" \\
  --rdzv-id "$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}" &
srun_pid=$!
# A trapped signal ends `wait` early (status 128 + signal): wait again for srun's own status,
# which bash keeps even if srun ended meanwhile (127: collected already, keep the last one).
rc=
while :; do
  interrupted=
  status=0
  wait "$srun_pid" || status=$?
  if [ "$status" -eq 127 ] && [ -n "$rc" ]; then break; fi
  rc=$status
  [ -n "$interrupted" ] || break
done
{rc_read}
if [ "$rc" -eq {EXIT_PREEMPTED} ] && [ "$stop" = time-limit ]; then
  # {EXIT_PREEMPTED}: stopped after the last-gasp checkpoint. The requeued run resumes from it.
  echo "wanka: checkpoint written; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""
    return "\n".join(head) + "\n" + body


def submit(script: Path) -> str:
    """`sbatch SCRIPT`; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ValueError(f"sbatch not found on PATH: submit {script} from a Slurm login node "
                         "(`sbatch FILE`), or drop --submit")  # fmt: skip
    p = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        raise ValueError(f"sbatch rejected {script}: {why}")
    return p.stdout.strip().split(";")[0]  # "JOBID" or "JOBID;CLUSTER"
