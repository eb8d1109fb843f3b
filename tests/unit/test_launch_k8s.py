"""`wanka launch --k8s`: the manifests checked field by field against the Kubernetes API models
(the `kubernetes` client) and the PyTorchJob models (`kubeflow-training`, the training
operator's SDK); the JobSet top level against a schema written from JobSet's Go types
(api/jobset/v1alpha2/jobset_types.go: no JobSet SDK is published on PyPI), its Job and pod
templates against the Kubernetes models. Unknown fields, wrong types and missing required
fields are all caught (negative controls below). Also: anti-affinity from the fault ledger,
the container's `wanka train` command, the JobSet DNS wait, and the YAML writer."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="pip install kubernetes (dev extra)")
kf = pytest.importorskip("kubeflow.training", reason="pip install kubeflow-training (dev extra)")
yaml = pytest.importorskip("yaml")

from wanka.launch.cli import add_launch_parser  # noqa: E402
from wanka.launch.k8s import to_yaml  # noqa: E402
from wanka.resilience.ledger import FaultLedger  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/demo.toml"  # as the container sees it, relative to its working directory
NAME = "demo-958082"  # its job's default name: run.dir's folder, a hash of the whole path

# JobSet v1alpha2, from its Go types: field -> type. Types are these names, Kubernetes model
# names (V1...), or list[...] / dict(str, ...) of them. Required fields (no omitempty) below.
JOBSET_SCHEMA = {
    "JobSet": {"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta",
               "spec": "JobSetSpec", "status": "object"},
    "JobSetSpec": {"replicatedJobs": "list[ReplicatedJob]", "network": "Network",
                   "successPolicy": "SuccessPolicy", "failurePolicy": "FailurePolicy",
                   "startupPolicy": "StartupPolicy", "suspend": "bool",
                   "coordinator": "Coordinator", "managedBy": "str",
                   "ttlSecondsAfterFinished": "int", "volumeClaimPolicies": "list[object]"},
    "ReplicatedJob": {"name": "str", "groupName": "str", "template": "V1JobTemplateSpec",
                      "replicas": "int", "dependsOn": "list[DependsOn]"},
    "DependsOn": {"name": "str", "status": "str"},
    "Network": {"enableDNSHostnames": "bool", "subdomain": "str",
                "publishNotReadyAddresses": "bool"},
    "SuccessPolicy": {"operator": "str", "targetReplicatedJobs": "list[str]"},
    "FailurePolicy": {"maxRestarts": "int", "restartStrategy": "str",
                      "rules": "list[FailurePolicyRule]"},
    "FailurePolicyRule": {"name": "str", "action": "str", "onJobFailureReasons": "list[str]",
                          "onJobFailureMessagePatterns": "list[str]",
                          "targetReplicatedJobs": "list[str]"},
    "StartupPolicy": {"startupPolicyOrder": "str"},
    "Coordinator": {"replicatedJob": "str", "jobIndex": "int", "podIndex": "int"},
}  # fmt: skip
JOBSET_REQUIRED = {"ReplicatedJob": ("name", "template"), "DependsOn": ("name", "status"),
                   "FailurePolicyRule": ("name", "action"), "SuccessPolicy": ("operator",),
                   "StartupPolicy": ("startupPolicyOrder",), "Coordinator": ("replicatedJob",)}  # fmt: skip
_PRIMITIVE = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def strict(data, typ: str, path: str = "") -> list[str]:
    """Problems with `data` as an instance of `typ`: unknown fields (what the API server's
    strict field validation rejects), wrong types, missing required JobSet fields."""
    if typ.startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [p for i, x in enumerate(data) for p in strict(x, typ[5:-1], f"{path}[{i}]")]
    if typ.startswith("dict("):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        inner = re.fullmatch(r"dict\([^,]+, (.*)\)", typ).group(1)
        return [p for k, v in data.items() for p in strict(v, inner, f"{path}.{k}")]
    if typ == "object":
        return []
    if typ in _PRIMITIVE:
        ok = isinstance(data, _PRIMITIVE[typ]) and not (typ == "int" and isinstance(data, bool))
        return [] if ok else [f"{path}: {data!r} is not {typ}"]
    if typ in JOBSET_SCHEMA:
        fields = JOBSET_SCHEMA[typ]
        missing = [f"{path}.{f}: required" for f in JOBSET_REQUIRED.get(typ, ()) if f not in data]
    else:
        model = getattr(kf.models, typ)  # kubeflow.training.models re-exports kubernetes'
        fields = {json_key: model.openapi_types[attr] for attr, json_key in
                  model.attribute_map.items()}  # fmt: skip
        missing = []
    if not isinstance(data, dict):
        return [f"{path}: expected a {typ} mapping"]
    out = missing
    for k, v in data.items():
        if k not in fields:
            out.append(f"{path}.{k}: unknown field of {typ}")
        else:
            out += strict(v, fields[k], f"{path}.{k}")
    return out


class _Response:  # what ApiClient.deserialize reads
    def __init__(self, data) -> None:
        self.data = json.dumps(data)


def as_model(data: dict, typ: str):
    """Deserialize with the client's own code, which enforces required fields (ValueError)."""
    return kf.ApiClient().deserialize(_Response(data), typ)


def model_problems(data: dict, typ: str) -> list[str]:
    """Required fields missing, or a round trip through the model that does not give the input
    back (a field dropped as unknown, a value coerced to the field's type)."""
    try:
        obj = as_model(data, typ)
    except ValueError as e:
        return [f"{typ}: {e}"]
    back = kf.ApiClient().sanitize_for_serialization(obj)
    return [] if back == data else [f"{typ}: the model's round trip differs from the manifest"]


def validate_pytorchjob(doc: dict) -> list[str]:
    return strict(doc, "KubeflowOrgV1PyTorchJob") + model_problems(doc, "KubeflowOrgV1PyTorchJob")


def validate_jobset(doc: dict) -> list[str]:
    problems = strict(doc, "JobSet")
    for rj in doc["spec"]["replicatedJobs"]:  # the Kubernetes part, through its models
        if "template" in rj:
            problems += model_problems(rj["template"], "V1JobTemplateSpec")
    return problems


# run.dir must be on the claim every pod mounts: the demo's runs/demo, in --workdir /data.
SHARED = ("--pvc", "shared:/data", "--workdir", "/data")


def launch(*argv: str, out: Path) -> dict:
    if "--pvc" not in argv:
        argv = (*argv, *SHARED)
    p = argparse.ArgumentParser(prog="wanka")
    add_launch_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["launch", "--k8s", CONFIG, *argv, "--out", str(out)])
    a.argv = ["launch", "--k8s", CONFIG, *argv]
    cwd = os.getcwd()
    os.chdir(REPO)  # the config path is relative, as inside the container
    try:
        assert a.fn(a) == 0
    finally:
        os.chdir(cwd)
    doc = yaml.safe_load(out.read_text())
    return doc


def pod_spec(doc: dict) -> dict:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.fixture
def ledger(tmp_path) -> str:
    return str(tmp_path / "faults.sqlite")


def test_pytorchjob_matches_the_operator_models(tmp_path, ledger):
    doc = launch("--nodes", "2", "--gpus-per-node", "8", "--image", "reg.example/wanka:1.0",
                 "--min-nodes", "2", "--max-nodes", "4", "--ledger", ledger, "--pvc",
                 "train-data:/data", "--workdir", "/data/wanka", out=tmp_path / "job.yaml")  # fmt: skip
    assert validate_pytorchjob(doc) == []
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = doc["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29500, "rdzvId": NAME,
                                     "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 10}  # fmt: skip
    assert spec["nprocPerNode"] == "8" and list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "OnFailure"
    # What the operator's validation requires (pkg/webhooks/pytorch): a DNS-1035 name, the
    # `pytorch` container, and the named port it builds PET_RDZV_ENDPOINT from.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    (c,) = pod_spec(doc)["containers"]
    assert c["name"] == "pytorch"
    assert {"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert {"name": "shared", "mountPath": "/data"} in c["volumeMounts"]
    assert c["workingDir"] == "/data/wanka"
    assert pod_spec(doc)["terminationGracePeriodSeconds"] == 300


def test_jobset_matches_its_schema_and_the_core_models(tmp_path, ledger):
    doc = launch("--nodes", "3", "--nproc", "2", "--image", "wanka:1", "--kind", "jobset",
                 "--accelerator-resource", "none", "--namespace", "ml", "--ledger", ledger,
                 out=tmp_path / "js.yaml")  # fmt: skip
    assert validate_jobset(doc) == []
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert doc["metadata"]["namespace"] == "ml"
    assert doc["spec"]["failurePolicy"] == {"maxRestarts": 10}
    (rj,) = doc["spec"]["replicatedJobs"]
    assert rj["replicas"] == 3
    job = rj["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 0)
    # Job validation: a podFailurePolicy needs restartPolicy Never; pod conditions need status.
    assert pod_spec(doc)["restartPolicy"] == "Never"
    rules = job["podFailurePolicy"]["rules"]
    assert {"type": "DisruptionTarget", "status": "True"} in rules[0]["onPodConditions"]
    assert rules[1]["onExitCodes"] == {"containerName": "pytorch", "operator": "In", "values": [75]}
    assert "resources" not in pod_spec(doc)["containers"][0]  # --accelerator-resource none
    # Pod hostnames <jobset>-<rjob>-<job>-<pod> are DNS labels (<= 63).
    assert len(f"{doc['metadata']['name']}-{rj['name']}-{rj['replicas'] - 1}-0") <= 63


# The last column: whether the client's own round trip must notice too (every part it models).
@pytest.mark.parametrize("kind,mutate,problem,client", [
    ("pytorchjob", lambda d: d["spec"].update(elasticPolicyy=d["spec"].pop("elasticPolicy")),
     "elasticPolicyy: unknown field of KubeflowOrgV1PyTorchJobSpec", True),
    ("pytorchjob", lambda d: pod_spec(d).update(restartPolicyy="Never"),
     "restartPolicyy: unknown field of V1PodSpec", True),
    ("pytorchjob", lambda d: pod_spec(d)["containers"][0].update(imagePullPolcy="Always"),
     "imagePullPolcy: unknown field of V1Container", True),
    ("pytorchjob", lambda d: pod_spec(d)["containers"][0]["ports"][0].update(containerPort="29500"),
     "containerPort: '29500' is not int", True),
    ("jobset", lambda d: d["spec"].update(failurPolicy=d["spec"].pop("failurePolicy")),
     "failurPolicy: unknown field of JobSetSpec", False),
    ("jobset", lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].update(backofLimit=0),
     "backofLimit: unknown field of V1JobSpec", True),
    ("jobset", lambda d: pod_spec(d)["affinity"]["podAntiAffinity"].update(requiredDuringScheduling=[]),
     "requiredDuringScheduling: unknown field of V1PodAntiAffinity", True),
    ("jobset", lambda d: d["spec"]["replicatedJobs"][0].pop("template"),
     "template: required", False),
])  # fmt: skip
def test_negative_control_bad_fields_are_caught(tmp_path, ledger, kind, mutate, problem, client):
    doc = launch("--nodes", "2", "--image", "wanka:1", "--kind", kind, "--ledger", ledger,
                 out=tmp_path / "x.yaml")  # fmt: skip
    validate = validate_pytorchjob if kind == "pytorchjob" else validate_jobset
    assert validate(copy.deepcopy(doc)) == []
    bad = copy.deepcopy(doc)
    mutate(bad)
    problems = validate(bad)
    assert any(problem in p for p in problems), problems
    # The client alone does not say which field, but its round trip notices.
    assert any("round trip differs" in p for p in problems) == client, problems


def test_negative_control_missing_required_field_fails_deserialization(tmp_path, ledger):
    doc = launch("--nodes", "2", "--image", "wanka:1", "--ledger", ledger, out=tmp_path / "x.yaml")
    del pod_spec(doc)["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        as_model(doc, "KubeflowOrgV1PyTorchJob")


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
def test_evicted_nodes_get_node_anti_affinity(tmp_path, ledger, kind):
    args = ("--nodes", "2", "--image", "wanka:1", "--kind", kind, "--ledger", ledger)
    doc = launch(*args, out=tmp_path / "a.yaml")
    assert "nodeAffinity" not in pod_spec(doc)["affinity"]  # no ledger file: nothing excluded
    led = FaultLedger(ledger)
    led.evict("gke-pool-b-7", "2 x hang within 3600 s")
    led.evict("gke-pool-a-3", "3 faults within 3600 s")
    doc = launch(*args, out=tmp_path / "b.yaml")
    aff = pod_spec(doc)["affinity"]
    terms = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "NotIn",
         "values": ["gke-pool-a-3", "gke-pool-b-7"]}]}]}  # fmt: skip
    # And one pod per node: this job's pods repel each other on a hostname.
    (anti,) = aff["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == {"app.kubernetes.io/instance": NAME}
    validate = validate_pytorchjob if kind == "pytorchjob" else validate_jobset
    assert validate(doc) == []
    # The node name comes from the downward API, so the ledger records Kubernetes node names.
    env = pod_spec(doc)["containers"][0]["env"]
    assert {"name": "WANKA_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in env
    led.clear("gke-pool-a-3")
    doc = launch(*args, out=tmp_path / "c.yaml")
    terms = pod_spec(doc)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gke-pool-b-7"]


def _train_args(command: list[str]) -> argparse.Namespace:
    from wanka.cli import build_parser

    i = command.index("train")
    return build_parser().parse_args(command[i:])


def test_pytorchjob_command_uses_the_operators_rendezvous(tmp_path, ledger):
    doc = launch("--nodes", "2", "--gpus-per-node", "4", "--image", "wanka:1", "--ledger", ledger,
                 "--set", "train.steps=9", out=tmp_path / "x.yaml")  # fmt: skip
    cmd = pod_spec(doc)["containers"][0]["command"]
    assert cmd[0] == "wanka"
    # The kubelet expands $(VAR) from the container's env, which the operator fills in.
    env = {"PET_NNODES": "2:2", "PET_RDZV_ENDPOINT": "demo-worker-0:29500", "PET_RDZV_ID": NAME}
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], x) for x in cmd]
    a = _train_args(expanded)
    assert (a.config, a.nproc, a.set) == (CONFIG, 4, ["train.steps=9"])
    rdzv = (a.nnodes, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id)
    assert rdzv == ("2:2", "c10d", "demo-worker-0:29500", NAME)


def _kubelet(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command argument: $$ -> $, $(VAR) -> its value when VAR
    is in the container's env (else left as written)."""
    return re.sub(
        r"\$\$|\$\((\w+)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
def test_user_text_reaches_wanka_train_unexpanded(tmp_path, ledger, kind):
    value = 'run.dir="/data/run $(WANKA_NODE) $$HOME"'
    doc = launch("--nodes", "2", "--image", "wanka:1", "--kind", kind, "--ledger", ledger,
                 "--set", value, out=tmp_path / "x.yaml")  # fmt: skip
    env = {"WANKA_NODE": "n7", "PET_NNODES": "2:2", "PET_RDZV_ENDPOINT": "e:1", "PET_RDZV_ID": "i"}
    cmd = [_kubelet(x, env) for x in pod_spec(doc)["containers"][0]["command"]]
    assert value in cmd  # exactly what was checked locally, not each pod's own run.dir
    assert _kubelet("$(WANKA_NODE)", env) == "n7"  # the stand-in kubelet does expand


def test_every_node_count_of_the_elastic_range_must_fit(tmp_path, ledger):
    # demo: ep = 2 with 1 rank per node: 2 and 4 nodes fit, 3 does not, and torchrun may form 3.
    with pytest.raises(ValueError, match="3"):
        launch("--nodes", "2", "--min-nodes", "2", "--max-nodes", "4", "--image", "w:1",
               "--ledger", ledger, out=tmp_path / "x.yaml")  # fmt: skip
    doc = launch("--nodes", "2", "--min-nodes", "2", "--max-nodes", "2", "--image", "w:1",
                 "--max-restarts", "5", "--ledger", ledger, out=tmp_path / "y.yaml")  # fmt: skip
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 5 * 2  # restarts summed over pods


def test_jobset_command_waits_for_dns_then_runs_wanka(tmp_path, ledger):
    doc = launch("--nodes", "2", "--image", "wanka:1", "--kind", "jobset", "--ledger", ledger,
                 out=tmp_path / "x.yaml")  # fmt: skip
    cmd = pod_spec(doc)["containers"][0]["command"]
    assert cmd[:2] == ["/bin/sh", "-c"] and cmd[3] == f"{NAME}-node-0-0.{NAME}"
    a = _train_args(cmd[4:])
    assert (a.nnodes, a.rdzv_endpoint, a.rdzv_id) == ("2", f"{NAME}-node-0-0.{NAME}:29500", NAME)
    # Run the wrapper: a `getent` that fails twice (name not in DNS yet), then resolves.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/asked\n'
                                    f'[ "$(wc -l < {tmp_path}/asked)" -ge 3 ]\n')  # fmt: skip
    (bin_dir / "getent").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run([*cmd[:4], "echo", "started", "train"], env=env, capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "started train", r.stderr
    assert (tmp_path / "asked").read_text().splitlines() == [f"hosts {NAME}-node-0-0.{NAME}"] * 3


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "huawei.com/Ascend910", "amd.com/gpu"])
def test_accelerator_resource_is_a_parameter(tmp_path, ledger, resource):
    doc = launch("--nodes", "2", "--gpus-per-node", "8", "--image", "wanka:1",
                 "--accelerator-resource", resource, "--ledger", ledger, out=tmp_path / "x.yaml")  # fmt: skip
    res = pod_spec(doc)["containers"][0]["resources"]
    assert res == {"limits": {resource: "8"}, "requests": {resource: "8"}}
    assert validate_pytorchjob(doc) == []


@pytest.mark.parametrize("argv,match", [
    (["--nodes", "0", "--image", "w:1"], "--nodes must be 1 or more"),
    (["--nodes", "2"], "--k8s needs --image"),
    (["--nodes", "2", "--image", "w:1", "--kind", "jobset", "--min-nodes", "1"], "need --kind pytorchjob"),
    (["--nodes", "2", "--image", "w:1", "--min-nodes", "3"], "--min-nodes \\(3\\) <= --nodes \\(2\\)"),
    (["--nodes", "2", "--image", "w:1", "--min-nodes", "1"], "1 node\\(s\\) x 1 rank\\(s\\)"),
    (["--nodes", "2", "--image", "w:1", "--accelerator-resource", "nvidia gpu"], "--accelerator-resource"),
    (["--nodes", "2", "--image", "w:1", "--gpus-per-node", "8", "--accelerator-resource", "none"], "name the resource"),
    (["--nodes", "2", "--image", "w:1", "--namespace", "ML"], "--namespace 'ML'"),
    (["--nodes", "2", "--image", "w:1", "--pvc", "data"], "--pvc 'data'"),
    (["--nodes", "2", "--image", "w:1", "--partition", "gpu"], "--partition: for --slurm, not --k8s"),
    (["--nodes", "2", "--image", "w:1", "--name", "Bad_Name"], "--name 'Bad_Name'"),
    (["--nodes", "1", "--min-nodes", "1", "--max-nodes", "100000000", "--image", "w:1"], "--max-nodes must be at most 10000"),
    (["--nodes", "3000000000", "--image", "w:1"], "at most 10000"),
    (["--nodes", "2", "--image", "w:1", "--max-restarts", "2000000000"], "--max-restarts 2000000000 is too many"),
    (["--nodes", "2", "--image", "w:1", "--pvc", "data:/dev/shm"], "/dev/shm is not a mount point"),
    (["--nodes", "2", "--image", "w:1", "--pvc", "data:/dev/shm/"], "/dev/shm/ is not a mount point"),
    (["--nodes", "2", "--image", "w:1", "--gpus-per-node", "1", "--accelerator-resource", "memory"], "vendor's domain"),
    (["--nodes", "2", "--image", "w:1", "--gpus-per-node", "1", "--accelerator-resource", "gpu"], "vendor's domain"),
    (["--nodes", "2", "--image", "w:1", "--gpus-per-node", "1", "--accelerator-resource", "kubernetes.io/gpu"], "vendor's domain"),
])  # fmt: skip
def test_bad_input_is_one_line(tmp_path, ledger, argv, match):
    out = tmp_path / "x.yaml"
    with pytest.raises(ValueError, match=match) as e:
        launch(*argv, "--ledger", ledger, out=out)
    assert "\n" not in str(e.value) and not out.exists()


TRICKY = ["yes", "No", "on", "OFF", "null", "Null", "~", "true", "8", "1.5", "1e3", "0x10", "1:30",
          "-x", "- x", "a: b", "a #b", "#c", "", " lead", "trail ", "multi\nline", "tab\there",
          "ü", "*a", "&a", "!x", "%x", "@x", "`x", "'q'", '"dq"', "[x]", "{x}", ">", "|", "?x",
          "$(PET_NNODES)", "a\\b", "nvidia.com/gpu", "None", ".inf", "-.inf", ".nan", "=",
          "<<", "2001-12-14", "y", "n"]  # fmt: skip


def test_a_pvc_name_is_a_dns_subdomain(tmp_path, ledger):
    doc = launch("--nodes", "2", "--image", "w:1", "--pvc", "my.claim:/data", "--workdir", "/data",
                 "--ledger", ledger, out=tmp_path / "x.yaml")  # fmt: skip
    spec = pod_spec(doc)
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "my.claim"}} in spec["volumes"]
    assert validate_pytorchjob(doc) == []


def test_an_accelerator_without_gpus_is_said_to_be_ignored(tmp_path, ledger, capsys):
    launch("--nodes", "2", "--image", "w:1", "--accelerator-resource", "amd.com/gpu",
           "--ledger", ledger, out=tmp_path / "x.yaml")  # fmt: skip
    err = capsys.readouterr().err
    assert "--accelerator-resource amd.com/gpu ignored: --gpus-per-node 0" in err


def test_the_default_name_tells_apart_runs_whose_folders_share_a_name():
    from wanka.launch import job_name

    a, b = job_name("/data/exp-a/run"), job_name("/data/exp-b/run")
    assert a != b and a.startswith("run-") and b.startswith("run-")
    assert job_name("/data/exp-a/run") == a  # stable
    for d in ("/data/exp-a/run", "/d/ünïcødé", "/d/日本語", "/d/9lives", "/d/" + "x" * 80, "/"):
        name = job_name(d)
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name), (d, name)
    assert job_name("/d/日本語").startswith("wanka-") and job_name("/d/日本語") != job_name(
        "/d/中文"
    )


NON_PRINTABLE = ["a\x85b", "\x7f", "x\x9fy", "\u2028", "p\u2029q", "\ufeff", "\xa0", "\x00",
                 "\U0001f600", "e\u0301", "\x1b[31m"]  # fmt: skip


def test_yaml_writer_escapes_what_yaml_would_not_read_back():
    doc = {"command": ["wanka", *NON_PRINTABLE], "m": {s: s for s in NON_PRINTABLE}}
    text = to_yaml(doc, header="made by: wanka --set x=\x85y: z\u2028w")
    assert yaml.safe_load(text) == doc
    assert all(c.isprintable() or c == "\n" for c in text)


def test_a_command_with_a_nel_reaches_the_container_exactly(tmp_path, ledger):
    value = 'run.dir="/data/a\x85b\x7fc"'
    doc = launch("--nodes", "2", "--image", "wanka:1", "--ledger", ledger, "--set", value,
                 out=tmp_path / "x.yaml")  # fmt: skip
    assert value.replace("$", "$$") in pod_spec(doc)["containers"][0]["command"]


def test_yaml_writer_round_trips(tmp_path):
    doc = {"s": TRICKY, "m": {s or "empty": s for s in TRICKY}, "n": [1, 0, -3, True, False, None],
           "e": {}, "l": [], "nested": [{"a": [1, [2, 3]], "b": {"c": []}}, [{"d": 1}]]}  # fmt: skip
    assert yaml.safe_load(to_yaml(doc, header="a\nheader")) == doc
