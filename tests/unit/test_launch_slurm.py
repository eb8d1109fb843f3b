"""`wanka launch --slurm`: the sbatch script's directives, its `wanka train` command line (parsed
by wanka's own parser), exclusions from the fault ledger, one-line errors, `--submit`, and the
script's stop / requeue logic run with bash against the stand-in srun (tests/cluster/
fake_slurm.py) and a stub in place of `wanka train`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wanka.launch.cli import add_launch_parser
from wanka.launch.slurm import parse_time
from wanka.resilience.ledger import FaultLedger

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/demo.toml")
FAKE_SLURM = REPO / "tests/cluster/fake_slurm.py"

# Stands in for `wanka train` on a node: records what it was started with, runs STUB_SECONDS,
# and on SIGTERM exits 75 as wanka train does after its last-gasp checkpoint, which takes
# STUB_GASP_<node id> seconds; a second TERM during it kills it (no handler left by then).
STUB = """
import json, os, signal, sys, time
out, node = os.environ["STUB_OUT"], os.environ["SLURM_NODEID"]
def stop(sig, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    open(f"{out}/term.{node}", "w").write(signal.Signals(sig).name)
    time.sleep(float(os.environ.get(f"STUB_GASP_{node}", "0")))
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
rec = {"argv": sys.argv[1:], "wanka_node": os.environ.get("WANKA_NODE"), "pid": os.getpid()}
open(f"{out}/task.{node}.json", "w").write(json.dumps(rec))
end = time.time() + float(os.environ.get("STUB_SECONDS", "0"))
while time.time() < end:
    time.sleep(0.02)
"""


def launch(*argv: str, capsys=None) -> int:
    p = argparse.ArgumentParser(prog="wanka")
    add_launch_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["launch", *argv])
    a.argv = ["launch", *argv]
    return a.fn(a)


def render(tmp_path: Path, *extra: str, name: str = "job.sbatch") -> str:
    out = tmp_path / name
    args = ["--slurm", CONFIG, "--nodes", "2", "--set", f'run.dir="{tmp_path / "run"}"',
            "--ledger", str(tmp_path / "faults.sqlite"), "--out", str(out), *extra]  # fmt: skip
    assert launch(*args) == 0
    return out.read_text()


def directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]


def train_argv(script: str) -> list[str]:
    """What srun runs on every node, after the `bash -c ... wanka-task` wrapper."""
    joined = script.replace("\\\n", " ")
    line = next(x for x in joined.splitlines() if x.startswith("srun "))
    words = shlex.split(line.rstrip("&"))
    return words[words.index("wanka-task") + 1 :]


def test_directives_and_train_command(tmp_path):
    script = render(tmp_path, "--gpus-per-node", "8", "--time", "04:00:00", "--partition", "gpu",
                    "--account", "ml", "--warn-seconds", "600", "--set", "train.steps=7")  # fmt: skip
    d = directives(script)
    for want in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=04:00:00",
                 "--partition=gpu", "--account=ml", "--signal=B:USR1@600", "--requeue",
                 "--open-mode=append", f"--chdir={os.getcwd()}", "--job-name=run"):  # fmt: skip
        assert want in d, (want, d)
    assert not any(x.startswith("--exclude") for x in d)  # no ledger yet: nothing excluded
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0

    # The nodes' command line is one `wanka train` accepts, with the rendezvous flags it has.
    argv = train_argv(script)
    assert argv[:3] == [sys.executable, "-m", "wanka.cli"]
    from wanka.cli import build_parser

    a = build_parser().parse_args(argv[3:])
    assert (a.cmd, a.config, a.nproc, a.nnodes) == ("train", CONFIG, 8, "2")
    rdzv = (a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id)
    assert rdzv == ("c10d", "$head:29500", "$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}")
    assert a.set == [f'run.dir="{tmp_path / "run"}"', "train.steps=7"]
    srun = next(x for x in script.splitlines() if x.startswith("srun "))
    assert "--wait=120" in srun and "--kill-on-bad-exit=0" in srun  # explicit: sites set it
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script


def test_gres_cpus_and_cpu_job(tmp_path):
    d = directives(render(tmp_path, "--gpus-per-node", "8", "--gres", "npu", "--nproc", "8"))
    assert "--gres=npu:8" in d and not any(x.startswith("--gpus-per-node") for x in d)
    cpu = render(tmp_path, "--cpus-per-task", "4", "--nproc", "1", name="cpu.sbatch")
    assert "--cpus-per-task=4" in directives(cpu)
    assert not any("gpu" in x or "gres" in x for x in directives(cpu))


def test_a_gres_without_gpus_is_said_to_be_ignored(tmp_path, capsys):
    script = render(tmp_path, "--gres", "npu", "--nproc", "1")
    assert not any("gres" in x for x in directives(script))
    assert "--gres npu ignored: --gpus-per-node 0" in capsys.readouterr().err


def test_with_ledger_none_the_summary_says_no_ledger_was_read(tmp_path, capsys):
    out = tmp_path / "x.sbatch"
    assert launch("--slurm", CONFIG, "--nodes", "2", "--set", f'run.dir="{tmp_path / "run"}"',
                  "--ledger", "none", "--out", str(out)) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "no node evicted (--ledger none)" in err and "in none" not in err


@pytest.mark.parametrize("text,seconds", [("04:00:00", 14400), ("90", 5400), ("30:15", 1815),
                                          ("2-00", 172800), ("1-02:03", 93780),
                                          ("1-00:00:30", 86430)])  # fmt: skip
def test_time_formats(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["4h", "04:00:60", "1:2:3:4", "", " 10", "0", "00:00:00", "-5"])
def test_bad_time_is_one_line(text):
    with pytest.raises(ValueError, match="--time") as e:
        parse_time(text)
    assert "\n" not in str(e.value)


def test_exclude_follows_the_ledger(tmp_path):
    ledger = FaultLedger(tmp_path / "faults.sqlite")
    ledger.evict("gpu11", "2 x hang within 3600 s")
    ledger.evict("gpu07", "3 faults within 3600 s (node_down, node_down, slow)")
    script = render(tmp_path)
    assert "--exclude=gpu07,gpu11" in directives(script)
    assert "gpu07: 3 faults within 3600 s" in script  # the reason, for whoever reads the script
    ledger.clear("gpu07")
    assert "--exclude=gpu11" in directives(render(tmp_path))
    # --ledger none: no exclusions even though the ledger has an evicted node.
    none = render(tmp_path, "--ledger", "none")
    assert not any(x.startswith("--exclude") for x in directives(none))
    # Default: the config's resilience.ledger.
    out = tmp_path / "default.sbatch"
    assert launch("--slurm", CONFIG, "--nodes", "2", "--out", str(out), "--set",
                  f'resilience.ledger="{tmp_path / "faults.sqlite"}"') == 0  # fmt: skip
    assert "--exclude=gpu11" in directives(out.read_text())
    # A name that cannot be a node would corrupt the directive: refused, not written.
    ledger.evict("a b;rm", "typo")
    with pytest.raises(ValueError, match="cannot be excluded"):
        render(tmp_path, name="bad.sbatch")
    assert not (tmp_path / "bad.sbatch").exists()


@pytest.mark.parametrize("argv,match", [
    (["--nodes", "0"], "--nodes must be 1 or more"),
    (["--nodes", "2", "--nproc", "0"], "--nproc must be 1 or more"),
    (["--nodes", "2", "--set", "parallel.ep=4"], "2 node\\(s\\) x 1 rank\\(s\\): .*ep"),
    (["--nodes", "2", "--set", "train.stepz=3"], "train.stepz"),
    (["--nodes", "2", "--time", "4h"], "--time '4h'"),
    (["--nodes", "2", "--time", "00:04:00"], "--warn-seconds 300 is not shorter"),
    (["--nodes", "2", "--partition", "a b"], "--partition 'a b'"),
    (["--nodes", "2", "--image", "x:1"], "--image: for --k8s, not --slurm"),
    (["--nodes", "2", "--gpus-per-node", "-1"], "--gpus-per-node must be 0 or more"),
])  # fmt: skip
def test_bad_input_is_one_line(tmp_path, argv, match):
    out = tmp_path / "x.sbatch"
    with pytest.raises(ValueError, match=match) as e:
        launch("--slurm", CONFIG, *argv, "--ledger", "none", "--out", str(out))
    assert "\n" not in str(e.value) and not out.exists()


def test_missing_config_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no such config file"):
        launch("--slurm", str(tmp_path / "nope.toml"), "--nodes", "2", "--ledger", "none")


def test_submit(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    run = ["--slurm", CONFIG, "--nodes", "2", "--ledger", "none", "--submit", "--set",
           f'run.dir="{tmp_path / "run"}"']  # fmt: skip
    with pytest.raises(ValueError, match="sbatch not found on PATH"):
        launch(*run)
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch.args\necho "4242;clusterA"\n')
    sbatch.chmod(0o755)
    assert launch(*run) == 0
    script = tmp_path / "run" / "launch" / "run.sbatch"
    assert capsys.readouterr().out.strip() == "submitted batch job 4242"
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", str(script)]
    assert script.read_text().startswith("#!/bin/bash")
    sbatch.write_text('#!/bin/sh\necho "sbatch: error: Invalid partition name specified" >&2\n'
                      "exit 1\n")  # fmt: skip
    with pytest.raises(ValueError, match="sbatch rejected .*: sbatch: error: Invalid partition"):
        launch(*run)


# -- the script itself, run by bash against the stand-in srun -----------------------------------


def run_script(tmp_path: Path, script: str, seconds: float, send: int | None = None, **env_extra):
    """bash SCRIPT on a 2-node stand-in allocation; `send` goes to the batch shell once both
    tasks run. Returns (exit code, {node id: task record}, {node id: signal the task got})."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    out.mkdir(exist_ok=True)
    subprocess.run([sys.executable, str(FAKE_SLURM), "install", str(bin_dir)], check=True)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="777",
               SLURM_JOB_NODELIST="node[07-08]", FAKE_SLURM_DIR=str(tmp_path / "slurm"),
               FAKE_SLURM_NODES=json.dumps([{"host": "node07"}, {"host": "node08"}]),
               STUB_OUT=str(out), STUB_SECONDS=str(seconds), **env_extra)  # fmt: skip
    p = subprocess.Popen(["bash", str(path)], env=env, stderr=subprocess.PIPE, text=True)
    if send is not None:
        deadline = time.monotonic() + 30
        while len(list(out.glob("task.*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(send)
    _, err = p.communicate(timeout=60)
    tasks = {int(f.name.split(".")[1]): json.loads(f.read_text()) for f in out.glob("task.*")}
    terms = {int(f.name.split(".")[1]): f.read_text() for f in out.glob("term.*")}
    return p.returncode, tasks, terms, err


def stub_script(tmp_path: Path) -> str:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    return render(tmp_path, "--wanka", f"{sys.executable} {stub}")


def requeued(tmp_path: Path) -> list[str]:
    f = tmp_path / "slurm" / "requeued"
    return f.read_text().split() if f.exists() else []


def test_script_runs_one_task_per_node(tmp_path):
    rc, tasks, terms, err = run_script(tmp_path, stub_script(tmp_path), seconds=0)
    assert rc == 0, err
    assert sorted(tasks) == [0, 1] and not terms and not requeued(tmp_path)
    assert [tasks[i]["wanka_node"] for i in (0, 1)] == ["node07", "node08"]
    for t in tasks.values():  # the first host of the expanded node list hosts the rendezvous
        a = t["argv"]
        assert a[a.index("--rdzv-endpoint") + 1] == "node07:29500"
        assert a[a.index("--rdzv-id") + 1] == "777.0" and a[a.index("--nnodes") + 1] == "2"


def test_time_limit_warning_checkpoints_and_requeues(tmp_path):
    rc, tasks, terms, err = run_script(tmp_path, stub_script(tmp_path), seconds=30,
                                       send=signal.SIGUSR1)  # fmt: skip
    # Every task got TERM (its last gasp) rather than SIGKILL, and the job went back in line.
    assert rc == 75, err
    assert terms == {0: "SIGTERM", 1: "SIGTERM"}
    assert requeued(tmp_path) == ["777"]


def test_preemption_checkpoints_without_requeueing_itself(tmp_path):
    rc, _, terms, err = run_script(tmp_path, stub_script(tmp_path), seconds=30,
                                   send=signal.SIGTERM)  # fmt: skip
    assert rc == 75, err
    assert terms == {0: "SIGTERM", 1: "SIGTERM"}
    assert requeued(tmp_path) == []  # Slurm requeues a preempted job (--requeue)


def test_negative_control_signalling_srun_loses_the_checkpoint(tmp_path):
    """The stand-in is faithful where it matters: a script that forwarded the stop request to
    srun itself would have its tasks SIGKILLed (no last gasp) and would not requeue."""
    script = stub_script(tmp_path)
    broken = script.replace('scancel --signal=TERM "$SLURM_JOB_ID"', 'kill -TERM "$srun_pid"')
    assert broken != script
    rc, _, terms, err = run_script(tmp_path, broken, seconds=30, send=signal.SIGUSR1)
    assert rc == 128 + signal.SIGKILL and terms == {} and requeued(tmp_path) == []
    assert "forcing job termination" in err


def test_a_slower_last_gasp_on_one_node_is_waited_for(tmp_path):
    script = stub_script(tmp_path)
    rc, _, terms, err = run_script(tmp_path, script, seconds=30, send=signal.SIGUSR1,
                                   STUB_GASP_1="1.5")  # fmt: skip
    assert rc == 75 and terms == {0: "SIGTERM", 1: "SIGTERM"}, err
    assert requeued(tmp_path) == ["777"]


def test_negative_control_kill_on_bad_exit_would_kill_the_slower_node(tmp_path):
    """Why the script uses srun --wait: with --kill-on-bad-exit, the first node to exit 75
    gets the slower one terminated in the middle of its own last gasp; no requeue follows."""
    script = stub_script(tmp_path)
    broken = script.replace("--kill-on-bad-exit=0", "--kill-on-bad-exit=1")
    assert broken != script
    rc, _, terms, err = run_script(tmp_path, broken, seconds=30, send=signal.SIGUSR1,
                                   STUB_GASP_1="1.5")  # fmt: skip
    assert rc == 128 + signal.SIGTERM and requeued(tmp_path) == [], err


def test_srun_ending_during_the_trap_keeps_its_exit_code(tmp_path):
    """srun often ends while the trap still runs (the tasks stop quickly): the script must
    report srun's status (75, and requeue), not the interrupted `wait`'s 128 + signal."""
    script = stub_script(tmp_path)
    slow = script.replace('scancel --signal=TERM "$SLURM_JOB_ID"',
                          'scancel --signal=TERM "$SLURM_JOB_ID"; sleep 1')  # fmt: skip
    assert slow != script
    rc, _, terms, err = run_script(tmp_path, slow, seconds=30, send=signal.SIGUSR1)
    assert rc == 75 and terms == {0: "SIGTERM", 1: "SIGTERM"}, err
    assert requeued(tmp_path) == ["777"]


@pytest.mark.parametrize("coordinator_says, srun_code, script_code", [
    ("0", 137, 0),  # a host killed on the way (its task 137): the job finished
    (None, 137, 137),  # the coordinator's own task killed: nothing written, srun's code
    ("75", 1, 75),  # a last gasp: the coordinator's 75, whatever the other tasks said
])  # fmt: skip
def test_store_control_no_kill_and_the_coordinators_exit_code(
    tmp_path, coordinator_says, srun_code, script_code
):
    script = render(tmp_path, "--set", 'resilience.control="store"')
    assert "--no-kill" in directives(script)
    srun = next(x for x in script.splitlines() if x.startswith("srun "))
    assert "--no-kill --kill-on-bad-exit=0" in srun and "--wait" not in srun
    # The script run with stand-ins: srun's task on the first node writes the job's code.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write = (f'mkdir -p "$(dirname "$WANKA_JOB_RC_FILE")"; echo {coordinator_says} > '
             '"$WANKA_JOB_RC_FILE"; ' if coordinator_says else "")  # fmt: skip
    stubs = {"srun": f"#!/bin/bash\n{write}exit {srun_code}\n",
             "scontrol": "#!/bin/bash\necho n0\n", "scancel": "#!/bin/bash\nexit 0\n"}  # fmt: skip
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7",
               SLURM_JOB_NODELIST="n[0-1]")  # fmt: skip
    p = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == script_code, p.stderr
    assert not list((tmp_path / "run").rglob("job-rc.*"))  # read once, then removed


def test_store_control_needs_the_supervisor(tmp_path):
    # Without the supervisor `wanka train` is plain torchrun: no coordinator ends the hosts'
    # tasks or writes the job's exit code, so the script keeps srun's --wait and its code.
    script = render(tmp_path, "--set", 'resilience.control="store"',
                    "--set", "resilience.supervise=false")  # fmt: skip
    assert "--no-kill" not in directives(script) and "WANKA_JOB_RC_FILE" not in script
    srun = next(x for x in script.splitlines() if x.startswith("srun "))
    assert "--wait=120 --kill-on-bad-exit=0" in srun
