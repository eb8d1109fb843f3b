"""The lab's verdict on a candidate that is the baseline's own code (truth: 1x), N times: how
far timing noise alone moves it. Task rmsnorm-cpu forward+backward at N=2048, D=1024 with 4
timed repeats, as the red-team suite evaluates (tests/unit/test_lab_redteam.py).

    .venv/bin/python benchmarks/lab_self_ratio.py [--n 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from wanka.lab.evaluator import EvalConfig, evaluate
from wanka.lab.task import Shape
from wanka.lab.tasks import get_task

SOURCE = "from wanka.lab.tasks.rmsnorm import reference as kernel  # noqa: F401\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    a = p.parse_args()
    t = dataclasses.replace(
        get_task("rmsnorm-cpu"), mode="fwd_bwd", grad_inputs=("x", "weight"),
        shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 2048, "D": 1024}),
    )  # fmt: skip
    cfg = EvalConfig(timeout_s=60, repeats=4, static_policy=False)
    ratios = []
    for _ in range(a.n):
        fb = evaluate(t, SOURCE, cfg)
        ratios.append(round(fb.speedup, 3) if fb.correct else fb.status)
        print(json.dumps({"verdict": ratios[-1], "times_ms": [round(x * 1e3, 1) for x in fb.details.get("times_s", [])],
                          "baseline_ms": [round(x * 1e3, 1) for x in fb.details.get("baseline_times_s", [])]}), flush=True)  # fmt: skip
    print(json.dumps({"ratios": ratios}))


if __name__ == "__main__":
    main()
