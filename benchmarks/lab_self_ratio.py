"""The lab's verdict on a candidate that is the baseline's own code (truth: 1x), N times: how
far timing noise alone moves it. Task rmsnorm-cpu forward+backward at N=2048, D=1024 with 4
timed repeats, as the red-team suite evaluates (tests/unit/test_lab_redteam.py). With
`--also FILE` each round also evaluates that source (order alternating with the control's):
e.g. a red-team attack, side by side with what noise alone gives.

    .venv/bin/python benchmarks/lab_self_ratio.py [--n 8] [--also FILE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from wanka.lab.evaluator import EvalConfig, evaluate
from wanka.lab.task import Shape
from wanka.lab.tasks import get_task

SOURCE = "from wanka.lab.tasks.rmsnorm import reference as kernel  # noqa: F401\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--also", action="append", default=[], metavar="FILE")
    a = p.parse_args()
    t = dataclasses.replace(
        get_task("rmsnorm-cpu"), mode="fwd_bwd", grad_inputs=("x", "weight"),
        shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 2048, "D": 1024}),
    )  # fmt: skip
    cfg = EvalConfig(timeout_s=60, repeats=4, static_policy=False)
    sources = [("control", SOURCE)] + [(Path(f).stem, Path(f).read_text()) for f in a.also]
    ratios: dict[str, list] = {name: [] for name, _ in sources}
    for i in range(a.n):
        for name, src in sources if i % 2 == 0 else sources[::-1]:
            fb = evaluate(t, src, cfg)
            ratios[name].append(round(fb.speedup, 3) if fb.correct else fb.status)
            print(json.dumps({"source": name, "verdict": ratios[name][-1],
                              "times_ms": [round(x * 1e3, 1) for x in fb.details.get("times_s", [])],
                              "baseline_ms": [round(x * 1e3, 1) for x in fb.details.get("baseline_times_s", [])]}), flush=True)  # fmt: skip
    print(json.dumps({"ratios": ratios if a.also else ratios["control"]}))


if __name__ == "__main__":
    main()
