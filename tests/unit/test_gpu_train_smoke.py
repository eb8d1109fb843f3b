"""benchmarks/gpu/train_smoke.py on the CPU (tiny flavor, 3 steps): the GPU training smoke
stays runnable, and its JSON holds the figures BENCHMARKS will quote."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "train_smoke.py"


def test_train_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--flavor", "tiny", "--steps", "3",
           "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["final_loss"] < result["first_loss"]
    assert "| cpu | tiny |" in out.with_suffix(".md").read_text()
