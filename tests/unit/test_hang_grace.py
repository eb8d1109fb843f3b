"""No false hangs: a phase's limit comes only from completed observations of that phase, and
the first occurrence of a phase in an attempt keeps the start-up grace."""

import os
import time

from wanka.resilience.heartbeat import Beat, Reporter, read_all
from wanka.resilience.monitor import HangMonitor, Timeouts


def test_entering_the_current_phase_again_records_nothing(tmp_path):
    rep = Reporter(tmp_path, rank=0, attempt=1)
    rep.enter("optimizer", step=0)  # gradient clipping ...
    since = rep.since
    time.sleep(0.02)
    rep.enter("optimizer", step=0)  # ... then the optimizer step of the same step
    beat = read_all(tmp_path)[0]
    assert beat.since == since, "the phase's clock restarted"
    assert beat.max_seconds["optimizer"] == 0.0, "a partial optimizer phase was recorded"
    rep.enter("data", step=1)
    assert read_all(tmp_path)[0].max_seconds["optimizer"] >= 0.02  # completed: now it counts


def test_the_jobs_own_code_is_its_own_phase_then_back_to_the_one_it_interrupted(tmp_path):
    rep = Reporter(tmp_path, rank=0, attempt=1)
    rep.enter("forward", step=3)
    try:
        with rep.during("user_code"):
            assert read_all(tmp_path)[0].phase == "user_code"
            time.sleep(0.02)
            raise ValueError("the reward raised")
    except ValueError:
        pass
    beat = read_all(tmp_path)[0]
    assert (beat.phase, beat.step) == ("forward", 3)
    assert beat.max_seconds["user_code"] >= 0.02  # the code's own time is learned apart
    # A reward that ran in milliseconds may run a completion's program for seconds next:
    # its limit never falls below the 30 s floor of phases whose cost is not the step's.
    t = Timeouts(tmp_path / "t.json", factor=3.0, floor=4.0, initial=120.0)
    t.learned.update({"user_code": 0.01, "forward": 0.01})
    assert t.limit("user_code") == 30.0 and t.limit("forward") == 4.0


def test_first_optimizer_step_keeps_the_start_up_grace(tmp_path):
    """The first real optimizer step (lazy AdamW state, a loaded machine) may take longer than
    the floor; before any optimizer phase completed, that is not a hang."""
    t = Timeouts(tmp_path / "t.json", factor=3.0, floor=4.0, initial=120.0)
    t.learned["optimizer"] = 0.01  # even a persisted tiny value from an earlier attempt
    mon = HangMonitor(t)
    now = time.time()
    first = Beat(0, os.getpid(), 2, 0, "optimizer", now - 30, now, {"forward": 1.0})
    assert mon.check({0: first}, now) is None
    later = Beat(0, os.getpid(), 2, 5, "optimizer", now - 30, now, {"optimizer": 0.5})
    hang = mon.check({0: later}, now)
    assert hang is not None and hang.limit_s == 4.0  # completed once: the learned limit rules
    assert mon.check({0: first}, now - 30 + 121) is not None  # the grace is not forever


def test_slow_first_step_under_load_does_not_trip_the_monitor(tmp_path):
    """A rank reporting a real step sequence, the first optimizer step slowed past the floor."""
    rep = Reporter(tmp_path / "hb", rank=0, attempt=1)
    t = Timeouts(tmp_path / "t.json", factor=3.0, floor=0.05, initial=120.0)
    mon = HangMonitor(t)
    for phase in ("data", "sync", "forward", "backward", "optimizer"):
        rep.enter(phase, step=0)
    rep.enter("optimizer", step=0)  # the trainer enters it twice per step
    time.sleep(0.2)  # 4x the floor: "slow" on a loaded machine
    beats = read_all(tmp_path / "hb")
    t.observe(beats.values())
    assert mon.check(beats, time.time()) is None
