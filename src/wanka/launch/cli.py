"""argparse wiring of `wanka launch --slurm | --k8s CONFIG ...`. The handler returns an exit
code; bad input raises ValueError (one line, exit 2 in wanka.cli). Nothing is written before
every input has been checked."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from wanka.launch import DEFAULT_RDZV_PORT, Job, check_job, evicted_nodes, job_name

SLURM_ONLY = ("partition", "time", "account", "submit", "gres", "cpus_per_task", "warn_seconds")
K8S_ONLY = ("image", "kind", "min_nodes", "max_nodes", "namespace", "accelerator_resource",
            "max_restarts", "grace_seconds", "pvc", "workdir")  # fmt: skip


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_mode(a: argparse.Namespace) -> None:
    """Options of the other mode are mistakes, not silently ignored."""
    wrong = [d for d in (K8S_ONLY if a.slurm else SLURM_ONLY) if getattr(a, d) not in (None, False)]
    if wrong:
        mode, other = ("--slurm", "--k8s") if a.slurm else ("--k8s", "--slurm")
        raise ValueError(f"{', '.join(_flag(d) for d in wrong)}: for {other}, not {mode}")
    if a.k8s and a.image is None:
        raise ValueError("--k8s needs --image (the container image with wanka installed)")
    given = a.gres if a.slurm else a.accelerator_resource
    if a.gpus_per_node == 0 and given not in (None, "none"):
        flag = "--gres" if a.slurm else "--accelerator-resource"
        print(f"wanka launch: {flag} {given} ignored: --gpus-per-node 0 requests no accelerator "
              "(a CPU job); set --gpus-per-node G to request G per node", file=sys.stderr)  # fmt: skip


def _job(a: argparse.Namespace, config: str, node_counts: range | tuple[int, ...] = ()) -> Job:
    if a.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be 0 or more (got {a.gpus_per_node})")
    nproc = a.nproc if a.nproc is not None else max(a.gpus_per_node, 1)
    if a.gpus_per_node and nproc > a.gpus_per_node:
        raise ValueError(f"--nproc {nproc} ranks per node but --gpus-per-node {a.gpus_per_node}: "
                         "each rank needs its own accelerator; use --nproc "
                         f"{a.gpus_per_node} or fewer")  # fmt: skip
    _check_out(a, config)
    cfg = check_job(config, a.set, a.nodes, nproc, node_counts)
    ledger = a.ledger if a.ledger is not None else cfg.resilience.ledger
    r = cfg.resilience
    # The ledger is read by the caller once every input is checked (its note is no error).
    # Store control is the supervisors': without them `wanka train` is plain torchrun, and
    # nothing would end the hosts' tasks (--no-kill) or write the job's exit code.
    return Job(config=config, sets=list(a.set), nodes=a.nodes, nproc=nproc, run_dir=cfg.run.dir,
               name=job_name(cfg.run.dir, a.name, hashed=a.k8s), ledger=ledger,
               store_control=r.supervise and r.control == "store")  # fmt: skip


def _check_out(a: argparse.Namespace, config: str) -> None:
    """--out may replace a script or manifest `wanka launch` wrote (run it again to refresh the
    exclusions), nothing else: never the config, never a file of the user's."""
    if a.out is None:
        return
    path = Path(a.out)
    if path.resolve() == Path(a.config).resolve():
        raise ValueError(f"--out {a.out} is the config file itself: pick another --out")
    if path.is_dir():
        raise ValueError(f"--out {a.out} is a directory: name the file to write, e.g. "
                         f"{path / 'job.yaml' if a.k8s else path / 'job.sbatch'}")  # fmt: skip
    if path.exists() and path.stat().st_size > 0:  # an empty file (mktemp) is fine to fill
        try:
            with path.open(encoding="utf-8", errors="replace") as f:
                head = "".join(f.readline() for _ in range(6)).lower()
        except OSError as e:
            raise ValueError(f"cannot write --out {a.out}: {e.strerror}") from None
        if "written by: wanka launch" not in head:
            raise ValueError(f"--out {a.out} exists and was not written by wanka launch: pick "
                             "another --out, or move the file aside")  # fmt: skip


def _wanka_cmd(a: argparse.Namespace, default: list[str]) -> list[str]:
    try:
        return shlex.split(a.wanka) if a.wanka else default
    except ValueError as e:
        raise ValueError(f"--wanka {a.wanka!r}: {e} (a command line, e.g. --wanka "
                         "'/opt/venv/bin/python -m wanka.cli')") from None  # fmt: skip


def _write(text: str, out: str | None) -> None:
    if out is None:
        sys.stdout.write(text)
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise ValueError(f"cannot write --out {out}: {e.strerror}") from None


def _excluded(job: Job) -> str:
    if not job.evicted:
        read = job.ledger and job.ledger.lower() != "none"
        return "no node evicted" + (f" in {job.ledger}" if read else " (--ledger none)")
    return f"excluding {', '.join(sorted(job.evicted))} (evicted in {job.ledger})"


def _slurm(a: argparse.Namespace) -> int:
    from wanka.launch.slurm import SlurmResources, check_chdir, check_resources, render, submit

    res = SlurmResources(gpus_per_node=a.gpus_per_node, gres=a.gres, cpus_per_task=a.cpus_per_task,
                         partition=a.partition, account=a.account, time=a.time,
                         warn_s=300 if a.warn_seconds is None else a.warn_seconds,
                         rdzv_port=a.rdzv_port)  # fmt: skip
    check_resources(res)
    check_chdir(os.getcwd())
    wanka = _wanka_cmd(a, [sys.executable, "-m", "wanka.cli"])
    # Absolute: the script runs in --chdir, but a path the user typed is relative to here.
    job = _job(a, str(Path(a.config).resolve()))
    job.evicted = evicted_nodes(job.ledger)
    text = render(job, res, wanka, os.getcwd(), how=shlex.join(["wanka", *a.argv]))
    out = a.out
    if a.submit and out is None:
        out = str(Path(job.run_dir) / "launch" / f"{job.name}.sbatch")
    _write(text, out)
    if out is not None:
        print(f"wrote {out}: {job.nodes} node(s) x {job.nproc} rank(s), {_excluded(job)}",
              file=sys.stderr)  # fmt: skip
    if a.submit:
        print(f"submitted batch job {submit(Path(out))}")
    return 0


def _k8s(a: argparse.Namespace) -> int:
    from wanka.launch.k8s import (
        K8sOptions,
        check_options,
        check_run_dir,
        node_range,
        render,
        to_yaml,
    )

    opts = K8sOptions(image=a.image, kind=a.kind or "pytorchjob", namespace=a.namespace,
                      min_nodes=a.min_nodes, max_nodes=a.max_nodes, gpus_per_node=a.gpus_per_node,
                      accelerator=a.accelerator_resource or "nvidia.com/gpu",
                      max_restarts=10 if a.max_restarts is None else a.max_restarts,
                      grace_s=300 if a.grace_seconds is None else a.grace_seconds,
                      rdzv_port=a.rdzv_port, pvc=a.pvc, workdir=a.workdir)  # fmt: skip
    check_options(a.nodes, opts)
    # The config path is the container's: as given, relative to its working directory. The
    # config must fit every node count of the elastic range.
    lo, hi = node_range(a.nodes, opts)
    wanka = _wanka_cmd(a, ["wanka"])
    job = _job(a, a.config, range(lo, hi + 1))  # torchrun may form any size in between
    check_run_dir(job.run_dir, opts)
    job.evicted = evicted_nodes(job.ledger)
    doc = render(job, opts, wanka)
    header = (f"{doc['kind']} {job.name}: {job.nodes} node(s) x {job.nproc} rank(s) of "
              f"`wanka train`, {_excluded(job)}\nwritten by: {shlex.join(['wanka', *a.argv])}\n"
              "kubectl apply -f FILE; docs/LAUNCH.md explains each field")  # fmt: skip
    _write(to_yaml(doc, header), a.out)
    if a.out is not None:
        print(f"wrote {a.out}: {header.splitlines()[0]}", file=sys.stderr)
    return 0


def _check_utf8(a: argparse.Namespace) -> None:
    """The script or manifest is UTF-8 text and carries the arguments (the command, the
    `written by` line): one that is not UTF-8 (a file name's bytes, which Python hands over as
    lone surrogates) is named here, not left to a codec error on writing, or to a manifest
    whose YAML the API server would read back as another name."""
    named = [(d, v) for d, v in vars(a).items() if d != "argv"] + [("argv", a.argv)]
    for dest, value in named:
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                what = {"config": "the config path", "argv": "argument"}.get(dest, _flag(dest))
                shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                raise ValueError(f"{what} {shown} is not valid UTF-8, which the script or "
                                 "manifest must be: pass UTF-8 text (for a file: rename it, or "
                                 "link to it under a UTF-8 name)") from None  # fmt: skip


def _launch(a: argparse.Namespace) -> int:
    a.argv = list(getattr(a, "argv", None) or ["launch"])  # wanka.cli sets it
    _check_mode(a)
    _check_utf8(a)
    return _slurm(a) if a.slurm else _k8s(a)


def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    """`wanka launch --slurm | --k8s CONFIG --nodes N ...`."""
    p = sub.add_parser("launch", help="write (and submit) a multi-node job: Slurm sbatch script "
                       "or Kubernetes PyTorchJob / JobSet manifest")  # fmt: skip
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--slurm", action="store_true", help="an sbatch script (srun + torchrun)")
    mode.add_argument("--k8s", action="store_true", help="a PyTorchJob or JobSet manifest")
    p.add_argument("config", help="TOML job file; run.dir must be on storage every node shares")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (passed on to wanka train)")  # fmt: skip
    p.add_argument("--nodes", type=int, required=True, help="nodes (one wanka train each)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="accelerators per node (0: a CPU job)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks per node (default: --gpus-per-node, or 1)")  # fmt: skip
    p.add_argument("--out", default=None, help="write here instead of standard output")
    p.add_argument("--ledger", default=None, help="fault ledger whose evicted nodes are kept "
                   "out (default: the config's resilience.ledger; 'none': no exclusions)")  # fmt: skip
    p.add_argument("--name", default=None, help="job name (default: from run.dir)")
    p.add_argument("--rdzv-port", type=int, default=DEFAULT_RDZV_PORT,
                   help="c10d rendezvous port on the first node")  # fmt: skip
    p.add_argument("--wanka", default=None, help="how the nodes run wanka (default: this Python "
                   "with -m wanka.cli for --slurm, `wanka` for --k8s)")  # fmt: skip
    s = p.add_argument_group("--slurm")
    s.add_argument("--partition", default=None, help="Slurm partition")
    s.add_argument("--account", default=None, help="Slurm account to charge")
    s.add_argument("--time", default=None, help="time limit, HH:MM:SS or D-HH:MM:SS")
    s.add_argument("--warn-seconds", type=int, default=None,
                   help="last-gasp checkpoint this long before the time limit (default 300)")  # fmt: skip
    s.add_argument("--gres", default=None,
                   help="generic resource name for the accelerators, e.g. npu: --gres=npu:G "
                        "instead of --gpus-per-node=G")  # fmt: skip
    s.add_argument("--cpus-per-task", type=int, default=None, help="CPUs for each node's task")
    s.add_argument("--submit", action="store_true", help="run sbatch on the script")
    k = p.add_argument_group("--k8s")
    k.add_argument("--image", default=None, help="container image with wanka installed")
    k.add_argument("--kind", choices=["pytorchjob", "jobset"], default=None,
                   help="Kubeflow PyTorchJob (default) or JobSet")  # fmt: skip
    k.add_argument("--min-nodes", type=int, default=None, help="PyTorchJob elastic minimum")
    k.add_argument("--max-nodes", type=int, default=None, help="PyTorchJob elastic maximum")
    k.add_argument("--namespace", default=None, help="Kubernetes namespace (default: kubectl's)")
    k.add_argument("--accelerator-resource", default=None,
                   help="nvidia.com/gpu (default), huawei.com/Ascend910, ... or none")  # fmt: skip
    k.add_argument("--max-restarts", type=int, default=None,
                   help="restarts of the whole job by the operator / JobSet (default 10)")  # fmt: skip
    k.add_argument("--grace-seconds", type=int, default=None,
                   help="SIGTERM to SIGKILL: room for the last-gasp checkpoint (default 300)")  # fmt: skip
    k.add_argument("--pvc", default=None, metavar="CLAIM:PATH",
                   help="mount a PersistentVolumeClaim at PATH: shared storage for run.dir "
                        "(which must be under PATH) and the ledger")  # fmt: skip
    k.add_argument("--workdir", default=None, help="the container's working directory")
    p.set_defaults(fn=_launch)
