"""Supervised `wanka train` onto a full checkpoint disk: training goes on, ends bitwise equal
to a fault-free run; a final checkpoint that cannot be written ends the job in one line.

The checkpoints live on a 128 MiB tmpfs mounted for the test (root on Linux; skipped, saying
why, elsewhere), so the injected disk_full fills that and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wanka.resilience.chaos import BALLAST, small_filesystem, tmpfs_unavailable
from wanka.resilience.drill import injected_faults
from wanka.resilience.goodput import read_timeline
from wanka.train.checkpoint import complete_checkpoints, verify

from .helpers import small_job, wanka

NO_TMPFS = tmpfs_unavailable()
pytestmark = pytest.mark.skipif(NO_TMPFS is not None, reason=f"no tmpfs: {NO_TMPFS}")


def small(tmp: Path, run: str) -> list[str]:
    # checkpoint.keep=1: the pre-flight wants room for 2 more checkpoints of 22 MiB on the tmpfs
    # (128 MiB: also when one is already there, at a resume).
    return small_job(tmp, run, keep=1)


def digest(tmp: Path, run: str) -> str:
    return json.loads((tmp / run / "summary.json").read_text())["state_digest"]


def leftovers(ckpts: Path) -> list[str]:
    """What a failed save or the fault could leave behind: partial saves, ballast files."""
    return sorted(p.name for p in ckpts.iterdir() if p.name.startswith((".partial", BALLAST)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diskfull")
    r = wanka("train", *small(tmp, "ref"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, digest(tmp, "ref")


def test_training_goes_on_through_a_full_checkpoint_disk(reference):
    tmp, ref_digest = reference
    # Full from step 1 to step 6 (the save of step 4 fails), room again for the saves of 8, 12.
    schedule = "disk_full@step=1,steps=5"
    with small_filesystem(tmp / "disk" / "checkpoints", 128) as ckpts:
        r = wanka("train", *small(tmp, "disk"), "--chaos", schedule)
        assert r.returncode == 0, r.stderr[-3000:]
        assert leftovers(ckpts) == []
        assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000012"]
        assert verify(ckpts / "step-00000012") is None
    assert digest(tmp, "disk") == ref_digest  # bitwise the fault-free result
    assert "checkpoint of step 4 NOT written" in r.stderr
    assert "checkpoint of step 8 written: saving works again" in r.stderr
    assert "restart" not in r.stderr  # no rank died over it
    events = read_timeline(tmp / "disk" / "resilience" / "timeline.jsonl")
    [fault] = [e for e in events if e["kind"] == "fault"]
    assert fault["cause"] == "checkpoint_write_failed" and fault["step"] == 4
    assert fault["detail"] == "No space left on device"
    saves = [e for e in events if e["kind"] == "checkpoint"]
    assert ["error" in e for e in saves] == [True, False, False]
    [row] = injected_faults(events, schedule, tmp / "disk" / "resilience" / "chaos")
    assert row["kind"] == "disk_full" and row["detected"]
    assert row["detected_as"] == "checkpoint_write_failed" and row["steps_lost"] == 0
    assert 0 < row["to_productive_s"] < 10  # the next step, not a restart


def test_a_final_checkpoint_onto_a_full_disk_ends_the_job_then_resumes(reference):
    tmp, ref_digest = reference
    with small_filesystem(tmp / "end" / "checkpoints", 128) as ckpts:
        # Full from step 9 for longer than the job: the final save (step 12) cannot be written.
        r = wanka("train", *small(tmp, "end"), "--chaos", "disk_full@step=9,for=600")
        assert r.returncode == 2, r.stderr[-3000:]  # not retried: a restart cannot free a disk
        reason = [x for x in r.stderr.splitlines() if "could not be written" in x]
        assert reason and reason[0].startswith("wanka train: checkpoint of step 12 could not be"), (
            r.stderr[-3000:]
        )
        assert "No space left on device" in reason[0] and "run the same command again" in reason[0]
        assert leftovers(ckpts) == []  # no partial save, and the ballast went with the job
        assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000008"]
        assert not (tmp / "end" / "summary.json").exists()
        # Room again: the same command resumes and writes the final checkpoint.
        again = wanka("train", *small(tmp, "end"))
        assert again.returncode == 0, again.stderr[-3000:]
        assert [p.name for p in complete_checkpoints(ckpts)] == ["step-00000012"]
    assert digest(tmp, "end") == ref_digest
    events = read_timeline(tmp / "end" / "resilience" / "timeline.jsonl")
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(f["cause"], f["step"]) for f in faults] == [("checkpoint_write_failed", 12)]
