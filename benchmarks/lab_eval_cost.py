"""Cost of one lab evaluation (wall seconds, end to end, fork server already warm) and the
verdict on a candidate that is the baseline's own code (should be ~1x).

    .venv/bin/python benchmarks/lab_eval_cost.py --task sparse_attention-cpu --n 4

Run it against another checkout's evaluator by putting that checkout's src first on
PYTHONPATH (the `evaluate(task, source)` call is the same), alternating the two in one
session, for a before/after comparison on the same (noisy, shared) machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import wanka
from wanka.lab.evaluator import evaluate
from wanka.lab.tasks import get_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="sparse_attention-cpu")
    ap.add_argument("--n", type=int, default=4, help="timed evaluations (after one warm-up)")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    task = get_task(a.task)
    evaluate(task, task.baseline)  # starts the fork server: not part of an evaluation's cost
    walls, speedups, statuses = [], [], []
    for _ in range(a.n):
        t0 = time.perf_counter()
        fb = evaluate(task, task.baseline)
        walls.append(time.perf_counter() - t0)
        statuses.append(fb.status)
        speedups.append(fb.speedup)
    print(json.dumps({
        "label": a.label, "evaluator": wanka.__file__, "task": a.task, "n": a.n,
        "wall_s_per_evaluation": walls, "median_wall_s": statistics.median(walls),
        "statuses": statuses, "speedups_of_baseline_vs_itself": speedups,
        "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
