"""Side by side on the CPU: `wanka train` with glibc's default malloc thresholds against the
fixed ones it sets (device.keep_freed_host_memory), runs interleaved A B B A ...

    python benchmarks/host_malloc_ab.py FLAVOR SEQ_LEN GLOBAL_BATCH STEPS NPROC ROUNDS
    python benchmarks/host_malloc_ab.py small 512 2 8 1 2

Each run is a real `wanka train` (the cases of `wanka bench train`, src/wanka/bench/train.py);
the first 2 steps are dropped, the median step time of the rest is kept. Prints each run (with
its peak memory, summary.json's peak_memory_mb) and the ratio of the medians (default / fixed:
above 1 = the fixed thresholds are faster).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from wanka.bench.train import CaseSpec, read_step_times, train_command


def main(argv: list[str]) -> int:
    flavor, seq, batch, steps, nproc, rounds = argv[0], *map(int, argv[1:6])
    spec = CaseSpec(flavor=flavor, seq_len=seq, global_batch=batch, steps=steps)
    medians: dict[str, list[float]] = {"default": [], "fixed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in ("default", "fixed") if r % 2 == 0 else ("fixed", "default"):
                run = Path(tmp) / f"{mode}{r}"
                env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
                if mode == "default":
                    env["WANKA_HOST_MALLOC"] = "default"
                p = subprocess.run(train_command(spec, nproc, run), env=env, capture_output=True,
                                   text=True)  # fmt: skip
                if p.returncode:
                    print(p.stderr[-2000:], file=sys.stderr)
                    return 1
                medians[mode].append(statistics.median(read_step_times(run / "metrics.jsonl")[2:]))
                peak = json.loads((run / "summary.json").read_text()).get("peak_memory_mb")
                print(f"{mode:8s} round {r}: median step {medians[mode][-1]:.4f} s, "
                      f"peak {peak:,.0f} MiB", flush=True)  # fmt: skip
    a, b = (statistics.median(medians[m]) for m in ("default", "fixed"))
    print(f"default {a:.4f} s, fixed {b:.4f} s: default / fixed = {a / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
