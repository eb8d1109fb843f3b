"""`wanka launch`: a multi-node `wanka train` for a scheduler. `--slurm` writes an sbatch script
(launch/slurm.py), `--k8s` a PyTorchJob or JobSet manifest (launch/k8s.py); both start one
`wanka train --nnodes N` per node, meeting at a c10d rendezvous, and keep the nodes the fault
ledger has evicted out of the job. What both share lives here: the job checked once, before
anything is written (see docs/LAUNCH.md)."""

from __future__ import annotations

import hashlib
import itertools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# One `wanka train` per node; its ranks meet the other nodes' ranks here (torchrun's c10d).
DEFAULT_RDZV_PORT = 29500
# Ledger node names end up in `#SBATCH --exclude=` and in a Kubernetes label selector: names
# outside this set could not be a Slurm node or a Kubernetes node anyway.
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


@dataclass
class Job:
    """A training job checked for a multi-node launch."""

    config: str  # the TOML job file as `wanka train` on the nodes will read it
    sets: list[str]  # --set overrides, passed on unchanged
    nodes: int
    nproc: int  # ranks per node
    run_dir: str
    name: str  # scheduler-side job name (DNS-1035 label: valid for Slurm and Kubernetes)
    evicted: dict[str, str] = field(default_factory=dict)  # node -> reason, from the ledger
    ledger: str | None = None  # where `evicted` came from (None: not read)
    # resilience.control = "store": the hosts' supervisors decide together, the job outlives
    # a host (hot spares, eviction inside the job; resilience/host_members.py)
    store_control: bool = False

    def train_args(self) -> list[str]:
        """`wanka train`'s own arguments, up to (not including) the rendezvous flags."""
        args = ["train", self.config]
        for s in self.sets:
            args += ["--set", s]
        return args + ["--nproc", str(self.nproc)]


def check_job(config: str, sets: list[str], nodes: int, nproc: int,
              node_counts: range | tuple[int, ...] = ()) -> object:  # fmt: skip
    """Load the config (one-line ConfigError if it does not) and check that its parallel
    degrees fit `nproc` ranks on each of `nodes` (and of every count in `node_counts`, for an
    elastic job). Returns the JobConfig."""
    from wanka.config import load_config

    if nodes < 1:
        raise ValueError(f"--nodes must be 1 or more (got {nodes})")
    if nproc < 1:
        raise ValueError(f"--nproc must be 1 or more (got {nproc}): ranks per node")
    cfg = load_config(config, sets)
    from wanka.distributed.parallel_dims import ParallelDims, ParallelError

    r = cfg.resilience
    if r.supervise and r.control == "store" and r.spare_nodes and nodes > 1:  # N - S train
        if r.spare_nodes >= nodes:
            raise ValueError(f"resilience.spare_nodes={r.spare_nodes} leaves no node to train on "
                             f"with --nodes {nodes}; allocate more nodes or fewer spares")  # fmt: skip
        nodes -= r.spare_nodes
        spare = r.spare_nodes
        node_counts = [n - spare for n in node_counts if n > spare]  # bounded by launch/k8s.py

    for n in itertools.chain((nodes,), (n for n in node_counts if n != nodes)):
        try:
            ParallelDims.from_config(cfg.parallel, n * nproc)
        except ParallelError as e:
            raise ValueError(f"{n} node(s) x {nproc} rank(s): {e}") from None
    return cfg


def evicted_nodes(ledger: str | None) -> dict[str, str]:
    """node -> reason for the nodes the fault ledger has evicted; {} with no ledger file yet
    (no supervised job has run) or with `--ledger none`."""
    if not ledger or ledger.lower() == "none":
        return {}
    if not Path(ledger).exists():  # said, not silent: a mistyped path would exclude nothing
        print(f"wanka launch: no fault ledger at {ledger}: no node excluded (pass --ledger PATH "
              "of the jobs' resilience.ledger, or --ledger none)", file=sys.stderr)  # fmt: skip
        return {}
    from wanka.resilience.ledger import FaultLedger

    evicted = FaultLedger(ledger, create=False).evicted()
    for node in evicted:
        if not _NODE_NAME.match(node):
            raise ValueError(f"fault ledger {ledger} evicted a node named {node!r}, which cannot "
                             f"be excluded from a scheduler: `wanka nodes --ledger {ledger} clear "
                             "NODE` it, or pass --ledger none")  # fmt: skip
    return evicted


def job_name(run_dir: str, given: str | None = None, hashed: bool = True) -> str:
    """A DNS-1035 label (lower-case letters, digits, '-', starting with a letter, at most 40
    characters so that Kubernetes' derived pod and service names stay under 63). `hashed`: the
    default one ends with a hash of run.dir's whole path (Kubernetes: the object's name and
    the rendezvous id, which must differ between runs; a Slurm job's name need not)."""
    if given is not None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", given):
            raise ValueError(f"--name {given!r}: use 1-40 lower-case letters, digits and '-', "
                             "starting with a letter and not ending with '-'")  # fmt: skip
        return given
    # The folder's name to read, and a hash of the whole path to tell apart runs whose folders
    # share a name (/data/exp-a/run, /data/exp-b/run): one job each, never one patched twice.
    digest = hashlib.sha256(str(run_dir).encode("utf-8", "surrogateescape")).hexdigest()[:6]
    base = re.sub(r"[^a-z0-9-]+", "-", Path(run_dir).name.lower()).strip("-")
    keep = 27 if hashed else 34
    base = re.sub(r"-+", "-", base)[:keep].strip("-")
    if not base[:1].isalpha():  # none of it ASCII, or a digit first
        base = f"wanka-{base}".strip("-")[:keep].strip("-")
    return f"{base}-{digest}" if hashed else base
