"""A stop request in the job's last step: the ranks are past their last stop agreement, so they
finish the job (final checkpoint, eval, summary). That is a finished job (exit 0), ended in
seconds: before, the elastic agent waited 30 s twice for the finished ranks, which only noted
the SIGTERM, then SIGKILLed them, and the job exited 75 "stopped on request ... without a
last-gasp checkpoint; run the same command again to resume"."""

import json
import time

from .helpers import small_job as small
from .helpers import wanka


def test_a_stop_request_in_the_last_step_ends_a_finished_job_at_once(tmp_path):
    t0 = time.monotonic()
    r = wanka("train", *small(tmp_path, "end"), "--chaos", "sigterm@step=12", timeout=240)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing to resume" in r.stderr, r.stderr[-3000:]
    assert "run the same command again" not in r.stderr
    summary = json.loads((tmp_path / "end" / "summary.json").read_text())
    assert summary["steps"] == 12
    assert (tmp_path / "end" / "checkpoints" / "step-00000012").is_dir()
    assert took < 45, f"{took:.0f} s: the agent waited out its 30 s close for finished ranks"
