"""A rank killed while it writes a periodic checkpoint (here: rank 0 in write_manifest at step
8). The job resumes from its in-memory snapshot at step 8, past that save: before, no later
pass wrote step 8 again, so the run kept 4 and 12 only and a job that then lost its memory
too fell back to 4. The hook is installed in the launching process; the ranks are forked
from it and inherit it."""

import subprocess
import sys

from .helpers import REPO
from .helpers import small_job as small

HOOKED = """
import os, sys
from pathlib import Path
import wanka.train.checkpoint as ck
marker = Path(sys.argv[1])
real = ck.write_manifest
def write_manifest(path, step, *a, **k):
    if step == 8 and not marker.exists():
        marker.write_text("killed")
        os._exit(9)  # rank 0 dies between DCP's files and the manifest
    return real(path, step, *a, **k)
ck.write_manifest = write_manifest
from wanka.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_checkpoint_cut_short_by_a_fault_is_written_after_the_resume(tmp_path):
    args = ["train", *small(tmp_path, "cut", keep=5)]
    r = subprocess.run([sys.executable, "-c", HOOKED, str(tmp_path / "killed"), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "killed").exists(), "the hook never fired: the test tests nothing"
    steps = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step-*"))
    assert steps == ["step-00000004", "step-00000008", "step-00000012"], steps


HOOKED_FINISH = """
import os, sys
from pathlib import Path
import wanka.train.trainer as tr
marker = Path(sys.argv[1])
real = tr._finish
def _finish(job, *a, **k):
    if job.is_main and not marker.exists():
        marker.write_text("killed")
        os._exit(9)  # rank 0 dies after the final eval's row, before the summary
    return real(job, *a, **k)
tr._finish = _finish
from wanka.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_final_eval_done_again_after_a_fault_is_logged_once(tmp_path):
    import json

    args = ["train", *small(tmp_path, "fin")]
    r = subprocess.run([sys.executable, "-c", HOOKED_FINISH, str(tmp_path / "killed"), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "killed").exists(), "the hook never fired: the test tests nothing"
    rows = [json.loads(x) for x in (tmp_path / "fin" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "eval"] == [12]
