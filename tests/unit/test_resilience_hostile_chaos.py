"""Hostile --chaos schedules (resilience/chaos.py): a fault given twice, and a kill/stop whose
rank is already gone."""

from __future__ import annotations

import subprocess
import time

import pytest

from wanka.resilience.chaos import ChaosDriver, parse_schedule
from wanka.resilience.heartbeat import Beat


class _Timeline:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def event(self, kind, t0, t1, **kw) -> None:
        self.events.append({"kind": kind, **kw})


@pytest.mark.parametrize("schedule", [
    "kill@step=5,rank=1;kill@step=5,rank=1",
    "kill@step=5,rank=1; kill @ step=5 , rank=1",  # whitespace variants are the same fault
    "stop@step=2;stop@step=2,rank=0",  # rank=0 is the default
    "corrupt_ckpt@step=5;corrupt_ckpt@step=5",  # twice flips the same bytes back
    "fail_start@node=1,times=1;fail_start@node=1,times=1",
])  # fmt: skip
def test_the_same_fault_twice_is_refused_in_one_line(schedule):
    with pytest.raises(ValueError) as e:
        parse_schedule(schedule, world=2)
    assert "given twice" in str(e.value) and "\n" not in str(e.value)


def test_repeats_that_are_distinct_faults_are_kept():
    # other ranks, other steps, and nan (its repeat fires on the loss guard's retry)
    faults = parse_schedule("kill@step=5,rank=0;kill@step=5,rank=1;kill@step=6,rank=1;"
                            "nan@step=3,rank=1;nan@step=3,rank=1", world=2)  # fmt: skip
    assert len(faults) == 5


def test_a_kill_of_a_rank_already_gone_does_not_break_the_poll(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()  # exited and reaped: its pid names no process now
    driver = ChaosDriver(parse_schedule("kill@step=2,rank=1"), tmp_path, "job",
                         str(tmp_path / "shm"), _Timeline())  # fmt: skip
    now = time.time()
    beats = {1: Beat(1, p.pid, 0, 1, "forward", now, now, {})}
    driver.poll(beats, now, 1)  # raised ProcessLookupError: the supervisor's poll stopped there
    assert not driver.fired and not driver.timeline.events  # not fired: the next attempt's rank
