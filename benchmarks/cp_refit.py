"""Refit a `wanka bench cp` run's cost model from its timings, with the pieces each rank held
re-derived from the run's own rows and plans (runs made before the bench recorded pieces),
so that the fit may take the position-profile form (cp_report.fit_cost).

    python benchmarks/cp_refit.py RUN.json OUT.json

OUT.json holds {"cost_model": ..., "fit": ...}: usable as `--cost` and `parallel.cp_cost`.
Plans are deterministic; a layout whose re-derived (tokens, sparse, dense) terms differ from
the recorded ones in some step (a dynamic plan made by an older planner) is left out of the
fit, and said so; contiguous and head-tail plans never change.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from wanka.bench.cp import builtin_lengths
from wanka.bench.cp_report import describe, fit_cost
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_plan import plan_step
from wanka.distributed.cp_sim import draw_rows


def records(run_json: dict) -> list[dict]:
    st = run_json["setup"]
    if not run_json["lengths"].get("source", "").startswith("builtin"):
        raise SystemExit("only runs on the built-in corpus's lengths can be re-derived here")
    lengths = builtin_lengths()
    dp, cp, calib = st["dp"], st["cp"], st["calibration_steps"]
    out = []
    for run in run_json["runs"]:
        rng = np.random.default_rng([st["seed"], run["seq_len"]])
        rows = [draw_rows(rng, lengths, dp, run["seq_len"]) for _ in range(1 + calib + st["steps"])]
        cost = CostModel(**run["plan_cost"])
        for layout, lay in run["layouts"].items():
            got = []
            for i, (terms, compute) in enumerate(zip(lay["terms"], lay["compute_s"])):
                plan = plan_step([[r] for r in rows[1 + calib + i]], cp, layout, cost)
                for rank in range(dp * cp):
                    mine = plan.piece_rank == rank
                    t = CostModel(topk=st["model"]["index_topk"]).terms(
                        plan.piece_start[mine], plan.piece_end[mine]
                    )
                    pieces = np.column_stack([plan.piece_start[mine], plan.piece_end[mine]])
                    got.append({"compute_s": compute[rank], "terms": terms[rank],
                                "pieces": pieces.tolist(),
                                "same": [int(x.sum()) for x in t] == list(terms[rank])})  # fmt: skip
            if all(r.pop("same") for r in got):
                out += got
            else:
                print(f"{run['seq_len']} {layout}: its plans differ from today's planner: left out")
    return out


if __name__ == "__main__":
    src, dst = sys.argv[1:3]
    doc = json.load(open(src))
    recs = records(doc)
    if not recs:
        raise SystemExit(f"{src}: no layout's plans could be re-derived")
    model, fit = fit_cost(recs, doc["setup"]["model"]["index_topk"])
    json.dump(
        {"cost_model": dataclasses.asdict(model), "fit": fit, "refit_of": src},
        open(dst, "w"),
        indent=1,
    )
    print(
        f"{fit['form']} ({fit['samples']} samples): {describe(model)}; mean relative error "
        f"{fit['mean_rel_error']:.1%} (terms {fit['mean_rel_error_terms']:.1%}), max "
        f"{fit['max_rel_error']:.1%}"
    )
