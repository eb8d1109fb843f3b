"""Issue 6 target: `search` on the CPU sparse-attention task, starting from the reference
gather implementation as baseline, within 200 evaluations; verified on held-out shapes.

    .venv/bin/python benchmarks/lab_search_cpu.py --budget 200 --out runs/lab/search_cpu.json

Same loop as `wanka lab run sparse_attention-cpu --proposer search --budget 200` (a fresh
history database unless --resume), plus a JSON record with every evaluation's status and
speedup, the best-so-far curve and the held-out verification.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from wanka.lab.proposers.search import SearchProposer
from wanka.lab.runner import RunConfig, run_task
from wanka.lab.store import Store
from wanka.lab.tasks import get_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="sparse_attention-cpu")
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", default="runs/lab/search_cpu.sqlite")
    ap.add_argument("--out", default="runs/lab/search_cpu.json")
    ap.add_argument("--resume", action="store_true", help="continue the history in --db")
    a = ap.parse_args()
    db = Path(a.db)
    if db.exists() and not a.resume:
        db.unlink()
    t0 = time.time()
    store = Store(db)
    task = get_task(a.task)
    summary = run_task(task, SearchProposer(seed=a.seed), store, RunConfig(budget=a.budget))
    hist = store.candidates(summary["run_id"])
    curve, best = [], 0.0
    for r in hist:
        if r.correct and r.speedup:
            best = max(best, r.speedup)
        curve.append(round(best, 3))
    target = next((r.n for r in hist if r.correct and (r.speedup or 0) >= 3.0), None)
    out = {
        **summary, "wall_s": round(time.time() - t0, 1), "first_eval_reaching_3x": target,
        "best_so_far": curve, "timing_shape": str(task.timing_shape),
        "held_out_timing_shape": str(task.held_out_timing),
        "evals": [{"n": r.n, "status": r.status, "speedup": r.speedup, "config": r.config}
                  for r in hist],
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg()},
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    v = summary["verified"]
    print(f"{a.task}: {summary['evaluations']} evaluations in {out['wall_s']:.0f} s; best "
          f"{summary['best']['speedup']:.2f}x (first >= 3x at evaluation {target}); held-out "
          f"{'verified' if v else 'NOT verified'}"
          + (f" at {summary['held_out_speedup']:.2f}x" if v else "") + f"; wrote {a.out}")  # fmt: skip
    return 0 if v and summary["held_out_speedup"] >= 3.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
