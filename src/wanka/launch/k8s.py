"""`wanka launch --k8s`: a Kubeflow PyTorchJob (kubeflow.org/v1, elastic policy) or a JobSet
(jobset.x-k8s.io/v1alpha2) manifest running one `wanka train` pod per node.

Field names follow the published APIs: the training operator's PyTorchJob (its Python SDK,
kubeflow-training, has the models the tests check against) and JobSet's Go types
(sigs.k8s.io/jobset api/jobset/v1alpha2). Both put the same pod template to work: container
`pytorch` (the operator finds its port by that name), WANKA_NODE from the downward API so the
fault ledger records Kubernetes node names, a memory-backed /dev/shm for the in-memory
snapshots, one pod per node (pod anti-affinity) and none on an evicted node (node affinity)."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

from wanka.launch import Job

EXIT_PREEMPTED = 75  # wanka train's exit code after a last-gasp checkpoint
CONTAINER = "pytorch"  # the PyTorchJob operator looks for this container ...
PORT_NAME = "pytorchjob-port"  # ... and this port on it for the rendezvous endpoint
REPLICATED_JOB = "node"  # JobSet: pods are <jobset>-node-<i>-0, subdomain <jobset>
INSTANCE_LABEL = "app.kubernetes.io/instance"
_RESOURCE = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A PersistentVolumeClaim's name is a DNS subdomain: labels joined by dots, 253 at most.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
INT32_MAX = 2**31 - 1  # replicas, backoffLimit, maxRestarts are int32 in the API
MAX_NODES = 10_000  # far beyond any one job; every count of an elastic range is checked


@dataclass
class K8sOptions:
    image: str
    kind: str = "pytorchjob"  # or "jobset"
    namespace: str | None = None
    min_nodes: int | None = None  # PyTorchJob elastic range (default: exactly Job.nodes)
    max_nodes: int | None = None
    gpus_per_node: int = 0
    accelerator: str = "nvidia.com/gpu"  # extended resource name, or "none"
    max_restarts: int = 10  # operator / JobSet restarts of the whole job
    grace_s: int = 300  # SIGTERM -> SIGKILL: room for the last-gasp checkpoint
    rdzv_port: int = 29500
    pvc: str | None = None  # "CLAIM:/mount/path": shared storage for run.dir and the ledger
    workdir: str | None = None


def check_options(nodes: int, o: K8sOptions) -> None:
    if nodes < 1:
        raise ValueError(f"--nodes must be 1 or more (got {nodes})")
    if o.kind not in ("pytorchjob", "jobset"):
        raise ValueError(f"--kind {o.kind!r}: pytorchjob or jobset")
    if not o.image or any(c.isspace() for c in o.image):
        raise ValueError(f"--image {o.image!r}: a container image reference, e.g. repo/wanka:1.0")
    if o.kind == "jobset" and (o.min_nodes is not None or o.max_nodes is not None):
        raise ValueError("--min-nodes/--max-nodes (elastic) need --kind pytorchjob")
    lo, hi = node_range(nodes, o)
    if nodes > MAX_NODES or hi > MAX_NODES:
        raise ValueError(f"--nodes/--max-nodes must be at most {MAX_NODES} (got {max(nodes, hi)})")
    if not 1 <= lo <= nodes <= hi:
        raise ValueError(f"need 1 <= --min-nodes ({lo}) <= --nodes ({nodes}) <= "
                         f"--max-nodes ({hi})")  # fmt: skip
    if o.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be 0 or more (got {o.gpus_per_node})")
    if o.accelerator != "none" and (
        not _RESOURCE.match(o.accelerator)
        or "/" not in o.accelerator
        or o.accelerator.split("/")[0].endswith("kubernetes.io")
    ):
        raise ValueError(f"--accelerator-resource {o.accelerator!r}: an extended resource name "
                         "with its vendor's domain, such as nvidia.com/gpu or "
                         "huawei.com/Ascend910, or none")  # fmt: skip
    if o.gpus_per_node and o.accelerator == "none":
        raise ValueError(f"--gpus-per-node {o.gpus_per_node} with --accelerator-resource none: "
                         "name the resource, or use --gpus-per-node 0 for a CPU job")  # fmt: skip
    if o.namespace is not None and not _DNS_LABEL.match(o.namespace):
        raise ValueError(f"--namespace {o.namespace!r}: lower-case letters, digits and '-'")
    if o.max_restarts < 0 or o.grace_s < 0:
        raise ValueError("--max-restarts and --grace-seconds must be 0 or more")
    if o.max_restarts * max(hi, 1) > INT32_MAX:  # the PyTorchJob's backoffLimit
        raise ValueError(f"--max-restarts {o.max_restarts} is too many (at most "
                         f"{INT32_MAX // max(hi, 1)} with {hi} node(s))")  # fmt: skip
    if o.grace_s > INT32_MAX:
        raise ValueError(f"--grace-seconds {o.grace_s} is too long (at most {INT32_MAX})")
    if not 0 < o.rdzv_port < 65535:  # the control store takes the next port
        raise ValueError(f"--rdzv-port must be 1-65534 (got {o.rdzv_port})")
    if o.workdir is not None and not o.workdir.startswith("/"):
        raise ValueError(f"--workdir {o.workdir!r}: the container's working directory must be an "
                         "absolute path, e.g. --workdir /data")  # fmt: skip
    if o.pvc is not None:
        claim, _, path = o.pvc.partition(":")
        if len(claim) > 253 or not _DNS_SUBDOMAIN.match(claim) or not path.startswith("/"):
            raise ValueError(f"--pvc {o.pvc!r}: CLAIM:/mount/path, e.g. --pvc train-data:/data")
        if ":" in path:  # Docker's CLAIM:/data:ro would mount at "/data:ro"
            raise ValueError(f"--pvc {o.pvc!r}: no ':' in the mount path (the claim is mounted "
                             "read-write, which run.dir needs: there is no :ro); e.g. --pvc "
                             f"{claim}:{path.split(':')[0]}")  # fmt: skip
        if posixpath.normpath(path) in ("/", "//", "/dev/shm"):
            raise ValueError(f"--pvc {o.pvc!r}: {path} is not a mount point for shared storage "
                             "(/dev/shm is the pod's memory for the in-memory snapshots); "
                             "mount the claim elsewhere, e.g. --pvc CLAIM:/data")  # fmt: skip


def check_run_dir(run_dir: str, o: K8sOptions) -> None:
    """run.dir must be on the --pvc volume: a pod's own filesystem would give each pod its own
    run directory (its own lock, a share of the checkpoint shards), lost with the pod."""
    example = f"--set run.dir={_mount(o.pvc) if o.pvc else '/data'}/runs/NAME"
    if not o.pvc:
        raise ValueError(f"run.dir {run_dir} is on no shared storage: each pod would write its "
                         "own, lost with the pod; add --pvc CLAIM:PATH (the claim every pod "
                         "mounts) and put run.dir under PATH, e.g. --pvc CLAIM:/data "
                         f"{example}")  # fmt: skip
    mount = _mount(o.pvc)
    if posixpath.isabs(run_dir):
        where = posixpath.normpath(run_dir)
    elif o.workdir:  # the container runs in --workdir
        where = posixpath.normpath(posixpath.join(o.workdir, run_dir))
    else:
        raise ValueError(f"run.dir {run_dir} is relative to the image's working directory, which "
                         f"is unknown here: pass --workdir under the --pvc mount {mount} (e.g. "
                         f"--workdir {mount}), or {example}")  # fmt: skip
    w, m = where.lstrip("/"), mount.lstrip("/")  # "//data" is "/data" to the kubelet too
    if w != m and not w.startswith(m + "/"):
        shown = run_dir if where == run_dir else f"{run_dir} ({where} in the container)"
        raise ValueError(f"run.dir {shown} is not under the --pvc mount {mount}: each pod would "
                         f"write its own, lost with the pod; {example}, or mount the storage "
                         "that holds run.dir with --pvc CLAIM:PATH")  # fmt: skip


def _mount(pvc: str) -> str:
    return posixpath.normpath(pvc.partition(":")[2])


def node_range(nodes: int, o: K8sOptions) -> tuple[int, int]:
    """The elastic range (min, max) of node counts; (nodes, nodes) when not elastic."""
    lo = nodes if o.min_nodes is None else o.min_nodes
    hi = nodes if o.max_nodes is None else o.max_nodes
    return lo, hi


def _pod_template(job: Job, o: K8sOptions, command: list[str], restart: str, port: str) -> dict:
    container: dict = {
        "name": CONTAINER,
        "image": o.image,
        "command": command,
        # The node, not the pod: what the fault ledger records and anti-affinity excludes.
        "env": [{"name": "WANKA_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        # The control store (resilience.control = "store") listens next to the rendezvous.
        "ports": [
            {"name": port, "containerPort": o.rdzv_port, "protocol": "TCP"},
            {"name": "wanka-control", "containerPort": o.rdzv_port + 1, "protocol": "TCP"},
        ],  # fmt: skip
        # In-memory snapshots live in /dev/shm; a container's default one is 64 MiB.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if o.gpus_per_node and o.accelerator != "none":
        n = str(o.gpus_per_node)  # quantities are strings in the API
        container["resources"] = {"limits": {o.accelerator: n}, "requests": {o.accelerator: n}}
    if o.pvc:
        claim = o.pvc.partition(":")[0]
        container["volumeMounts"].append({"name": "shared", "mountPath": _mount(o.pvc)})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": claim}})
    if o.workdir:
        container["workingDir"] = o.workdir
    affinity: dict = {
        # One pod per node, as with Slurm's one task per node.
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {INSTANCE_LABEL: job.name}},
             "topologyKey": "kubernetes.io/hostname"}]},
    }  # fmt: skip
    if job.evicted:
        # The ledger names nodes by spec.nodeName (WANKA_NODE), i.e. the Node object's name:
        # matched as a field, not through a label that may differ from it.
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": sorted(job.evicted)}]}]}}  # fmt: skip
    return {
        "metadata": {"labels": _labels(job)},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": o.grace_s,
            "affinity": affinity,
            "containers": [container],
            "volumes": volumes,
        },
    }


def _labels(job: Job) -> dict[str, str]:
    return {"app.kubernetes.io/name": "wanka", INSTANCE_LABEL: job.name}


def _metadata(job: Job, o: K8sOptions) -> dict:
    meta: dict = {"name": job.name, "labels": _labels(job)}
    if o.namespace:
        meta["namespace"] = o.namespace
    if job.evicted:  # why nodes are excluded, for whoever reads the live object
        reasons = "; ".join(f"{n}: {r}" for n, r in sorted(job.evicted.items()))
        meta["annotations"] = {"wanka/evicted-nodes": reasons}
    return meta


def pytorchjob(job: Job, o: K8sOptions, wanka: list[str]) -> dict:
    """Elastic PyTorchJob: Worker replicas only; the operator sets PET_NNODES (min:max),
    PET_RDZV_ENDPOINT (<name>-worker-0:port, whose hostname matches, so it hosts the store)
    and PET_RDZV_ID; the kubelet expands $(VAR) in the command from the container's env."""
    lo, hi = node_range(job.nodes, o)
    command = [*_literal([*wanka, *job.train_args()]), "--nnodes", "$(PET_NNODES)", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "$(PET_RDZV_ENDPOINT)", "--rdzv-id", "$(PET_RDZV_ID)"]  # fmt: skip
    # OnFailure: a container that exits (75 after a last gasp, or a crash) restarts in place
    # and resumes from the newest checkpoint; a deleted (preempted) pod is recreated.
    pod = _pod_template(job, o, command, "OnFailure", PORT_NAME)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, o),
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvPort": o.rdzv_port,
                "rdzvId": job.name,
                "minReplicas": lo,
                "maxReplicas": hi,
                "maxRestarts": o.max_restarts,
            },
            "nprocPerNode": str(job.nproc),
            # The operator counts container restarts summed over all pods: a stop that every
            # node takes together (exit 75 after a last gasp) counts once per node.
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": o.max_restarts * hi},
            "pytorchReplicaSpecs": {
                "Worker": {"replicas": job.nodes, "restartPolicy": "OnFailure", "template": pod}
            },
        },
    }


def _literal(args: list[str]) -> list[str]:
    """The kubelet expands $(VAR) in a container's command from its env and turns $$ into $:
    user text (config path, --set values) must reach `wanka train` exactly as checked here."""
    return [a.replace("$", "$$") for a in args]


def jobset_endpoint(job: Job) -> str:
    """Pod 0 of job 0, through the JobSet's headless service (subdomain = the JobSet's name)."""
    return f"{job.name}-{REPLICATED_JOB}-0-0.{job.name}"


def jobset(job: Job, o: K8sOptions, wanka: list[str]) -> dict:
    """JobSet: `nodes` single-pod Jobs. Pod 0 hosts the rendezvous store; c10d knows that by
    resolving the endpoint to its own address, so every pod first waits for the name to be in
    DNS (getent, from the image's libc)."""
    host = jobset_endpoint(job)
    wait = ('i=0; until getent hosts "$0" >/dev/null; do i=$((i+1)); if [ "$i" -ge 300 ]; then '
            'echo "wanka: $0 not in DNS after 300 s" >&2; exit 1; fi; sleep 1; done; exec "$@"')  # fmt: skip
    command = ["/bin/sh", "-c", wait, host, *_literal([*wanka, *job.train_args()]), "--nnodes", str(job.nodes),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{o.rdzv_port}",
               "--rdzv-id", job.name]  # fmt: skip
    pod = _pod_template(job, o, command, "Never", "rdzv")  # podFailurePolicy needs Never
    job_spec = {
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 0,  # any other failure fails the Job: the JobSet restarts all of them
        "podFailurePolicy": {
            "rules": [
                # Preempted or evicted pod, or a last gasp (every node exits 75 together): a new
                # pod, not counted as a failure; it rejoins the rendezvous and resumes.
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                {
                    "action": "Ignore",
                    "onExitCodes": {
                        "containerName": CONTAINER,
                        "operator": "In",
                        "values": [EXIT_PREEMPTED],
                    },
                },
            ]
        },
        "template": pod,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job, o),
        "spec": {
            "failurePolicy": {"maxRestarts": o.max_restarts},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "replicatedJobs": [
                {"name": REPLICATED_JOB, "replicas": job.nodes, "template": {"spec": job_spec}}
            ],
        },
    }


def render(job: Job, o: K8sOptions, wanka: list[str]) -> dict:
    check_options(job.nodes, o)
    return (pytorchjob if o.kind == "pytorchjob" else jobset)(job, o, wanka)


# -- YAML out (no PyYAML at run time): block style; strings plain only where YAML 1.1 and 1.2
# both read them back as the same string, double-quoted (JSON escapes are valid YAML) otherwise.
_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}


def _scalar(v: object) -> str:
    if isinstance(v, dict | list):  # only empty ones get here
        return "{}" if isinstance(v, dict) else "[]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return _escape(json.dumps(s, ensure_ascii=False))


def _escape(text: str) -> str:
    """Characters a YAML reader would not take back as themselves, escaped (\\uXXXX is valid
    in a double-quoted YAML string, and harmless in a comment): NEL (U+0085) and the line and
    paragraph separators are line breaks to it, DEL and C1 controls not printable at all."""
    return "".join(c if c.isprintable() or c in "\n\t" else
                   (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
                   for c in text)  # fmt: skip


def _lines(obj: dict | list, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, dict | list) and v:
                out.append(f"{pad}{_scalar(str(k))}:")
                # A list under a key sits at the key's indent ("key:\n- item"), a dict deeper.
                out += _lines(v, indent + 2 if isinstance(v, dict) else indent)
            else:
                out.append(f"{pad}{_scalar(str(k))}: {_scalar(v)}")
        return out
    for item in obj:
        if isinstance(item, dict | list) and item:
            sub = _lines(item, indent + 2)
            out += [f"{pad}- {sub[0].lstrip()}", *sub[1:]]
        else:
            out.append(f"{pad}- {_scalar(item)}")
    return out


def to_yaml(obj: dict, header: str = "") -> str:
    """`obj` as a YAML document, after `header` as comment lines."""
    comments = [f"# {_escape(line)}" for line in header.splitlines()]
    return "\n".join([*comments, *_lines(obj, 0)]) + "\n"
