"""The end of a job: processes that imported torch leave without the interpreter's teardown but
keep what a normal exit guarantees, and the supervisor (not rank 0, while every rank waits)
draws a train job's loss curve."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wanka.config import JobConfig
from wanka.resilience.supervisor import Supervisor

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from wanka.process_exit import exit_now

    out = open(sys.argv[1], "w")
    atexit.register(lambda: (out.write("atexit ran\\n"), out.close()))

    def late():
        time.sleep(0.3)
        out.write("thread finished\\n")

    threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
    # An idle pool's workers are not daemons either; threading's exit hook stops them.
    from concurrent.futures import ThreadPoolExecutor
    POOL = ThreadPoolExecutor(2)
    POOL.submit(time.sleep, 0.01).result()
    sys.stdout.write("unflushed")  # no newline, no flush
    exit_now({code})
""")


@pytest.mark.parametrize("code, rc", [("None", 0), ("0", 0), ("3", 3), ("130", 130)])
def test_exit_now_keeps_threads_atexit_and_output(tmp_path, code, rc):
    log = tmp_path / "log.txt"
    r = subprocess.run([sys.executable, "-c", PROGRAM.format(code=code), str(log)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == rc, r.stderr
    assert r.stdout == "unflushed"
    assert log.read_text() == "thread finished\natexit ran\n"  # the thread first, as sys.exit


def _supervisor(tmp_path, argv, rdzv=None) -> Supervisor:
    cfg = JobConfig()
    cfg.run.dir = str(tmp_path / "run")
    cfg.resilience.snapshot_dir = str(tmp_path / "shm")
    cfg.resilience.ledger = str(tmp_path / "faults.sqlite")
    return Supervisor(cfg, argv, 2, rdzv)


def test_only_the_one_supervisor_of_a_train_job_draws_its_loss_curve(tmp_path):
    assert _supervisor(tmp_path, ["train", DEMO]).draws_loss_curve
    assert _supervisor(tmp_path, ["train"], {"nnodes": "1"}).draws_loss_curve
    # Under Slurm every node has a supervisor on the shared run dir: rank 0 draws it (one writer).
    assert not _supervisor(tmp_path, ["train"], {"nnodes": "2"}).draws_loss_curve
    assert not _supervisor(tmp_path, ["train"], {"nnodes": "1:4"}).draws_loss_curve
    # Post-training runs draw their own curves with `wanka report`.
    assert not _supervisor(tmp_path, ["distill", "x.toml"]).draws_loss_curve


def _reference(tmp_path, overrides, drop=None):
    from wanka.config import dump_toml, load_config

    ref = tmp_path / "reference"
    ref.mkdir()
    text = dump_toml(load_config(DEMO, [*overrides, f'run.dir="{ref}"']))
    if drop:  # as written by a wanka that did not have this field yet
        text = "\n".join(x for x in text.splitlines() if not x.startswith(drop))
    (ref / "config.toml").write_text(text)
    (ref / "summary.json").write_text('{"state_digest": "ab12"}')
    return ref


def test_a_drill_reference_from_before_a_new_field_is_still_usable(tmp_path):
    from wanka.resilience.drill import _check_reference

    sets = ["train.steps=30", 'resilience.control="store"']
    _check_reference(_reference(tmp_path, sets, drop="warm_launchers ="), DEMO, sets)
    with pytest.raises(ValueError, match="another config .*steps = 30"):
        _check_reference(tmp_path / "reference", DEMO, ["train.steps=40"])
    with open(tmp_path / "reference" / "config.toml", "a") as f:
        f.write("\n[nonsense]\nx = 1\n")  # a section this wanka does not know
    with pytest.raises(ValueError, match="its config.toml does not read with this wanka"):
        _check_reference(tmp_path / "reference", DEMO, sets)


def test_a_launch_that_never_met_its_hosts_is_not_a_success(tmp_path, capsys, monkeypatch):
    """A rendezvous that never formed (the other hosts never came, or its endpoint was
    unreachable) left no exit codes, and an empty list of them read as success: exit 0 with
    nothing trained, which Slurm records as COMPLETED and never requeues."""
    from wanka.resilience.supervisor import Outcome

    sup = _supervisor(tmp_path, ["train", DEMO],
                      {"nnodes": "2", "rdzv_endpoint": "10.0.0.9:29500", "rdzv_id": "j"})  # fmt: skip
    sup.cfg.resilience.preflight = "off"
    out = Outcome("startup_failure", detail="RendezvousTimeoutError: timed out", launch_failed=True)
    sup._classify(out)
    assert out.cause == "startup_failure"  # was "success"
    monkeypatch.setattr(sup, "_attempt", lambda attempt: Outcome(
        "startup_failure", detail="RendezvousTimeoutError: timed out", launch_failed=True,
        never_met=True))  # fmt: skip
    assert sup._run() == 1
    err = [x for x in capsys.readouterr().err.splitlines() if "never met" in x]
    assert len(err) == 1 and "the 2 hosts never met at the rendezvous at 10.0.0.9:29500" in err[0]
    assert "nothing was trained" in err[0]
