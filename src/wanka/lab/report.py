"""`wanka lab report`: leaderboard, speedup over time, fast_p across tasks, a PNG of the
best-so-far curves, and export of a task's best candidate as an op-registry backend.

fast_p (KernelBench): the fraction of the suite's tasks whose candidate is correct and more
than p times faster than the baseline. The suite is every registered task runnable on this
device plus any task with runs in the history (or the list given); a task without a correct
run counts as a miss. Here "correct" means it also passed the held-out check, and its speedup
is the smaller of the visible and held-out measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

from wanka.lab.store import Record, Store
from wanka.lab.task import LabError

P_VALUES = (0.0, 1.0, 1.5, 2.0, 3.0)
MILESTONES = (1, 5, 10, 25, 50, 100, 200, 500, 1000)


def _final_speedup(r: Record) -> float | None:
    if not r.held_out_ok or not r.speedup:
        return None
    return min(r.speedup, r.held_out_speedup or r.speedup)


def best_per_task(store: Store) -> dict[str, dict]:
    """Per task, over all its runs: the best verified candidate (else the best unverified)."""
    out: dict[str, dict] = {}
    for run in store.runs():
        hist = store.candidates(run.id)
        row = out.setdefault(run.task, {"task": run.task, "runs": 0, "evaluations": 0,
                                        "best": None, "verified": None})  # fmt: skip
        row["runs"] += 1
        row["evaluations"] += len(hist)
        for r in hist:
            if r.correct and r.speedup and (row["best"] is None or r.speedup > row["best"].speedup):
                row["best"] = r
            f = _final_speedup(r)
            if f is not None and (row["verified"] is None or f > _final_speedup(row["verified"])):
                row["verified"] = r
    return out


def suite(rows: dict[str, dict] | None = None) -> list[str]:
    """The default fast_p denominator: registered tasks runnable here, plus tasks in rows."""
    from wanka.lab.tasks import all_tasks

    names = {n for n, t in all_tasks().items() if t.unavailable() is None}
    return sorted(names | set(rows or {}))


def fast_p(rows: dict[str, dict], ps=P_VALUES, tasks=None) -> dict[str, float]:
    """Fraction of `tasks` (default: suite(rows)) with a verified candidate faster than p x
    the baseline; tasks absent from rows are misses."""
    names = suite(rows) if tasks is None else list(dict.fromkeys(tasks))
    n = len(names)
    res = {}
    for p in ps:
        hits = 0
        for name in names:
            v = rows.get(name, {}).get("verified")
            hits += v is not None and _final_speedup(v) > p
        res[f"fast_{p:g}"] = hits / n if n else 0.0
    return res


def curve(hist: list[Record]) -> list[float]:
    """Best-so-far speedup after each evaluation (0 until something is correct)."""
    best, out = 0.0, []
    for r in hist:
        if r.correct and r.speedup:
            best = max(best, r.speedup)
        out.append(best)
    return out


def report(store: Store, png: Path | None = None, tasks=None) -> dict:
    """tasks: the fast_p suite (default: every task runnable here plus those with runs)."""
    rows = best_per_task(store)
    runs = []
    for run in store.runs():
        hist = store.candidates(run.id)
        c = curve(hist)
        ref = [r.reference_s / r.time_s for r in hist if r.correct and r.time_s and r.reference_s]
        runs.append({"run": run.id, "task": run.task, "proposer": run.proposer,
                     "evaluations": len(hist), "budget": run.budget,
                     "finished": run.finished is not None, "best_so_far": c,
                     "best_vs_reference": max(ref, default=None),
                     "milestones": {m: c[m - 1] for m in MILESTONES if m <= len(c)}})  # fmt: skip
    board = []
    for row in sorted(rows.values(), key=lambda r: r["task"]):
        b, v = row["best"], row["verified"]
        board.append({"task": row["task"], "runs": row["runs"], "evaluations": row["evaluations"],
                      "best_speedup": b.speedup if b else None,
                      "best_vs_reference": (b.reference_s / b.time_s) if b and b.reference_s else None,
                      "best_time_ms": b.time_s * 1e3 if b else None, "candidate": b.id if b else None,
                      "verified_candidate": v.id if v else None,
                      "held_out_speedup": v.held_out_speedup if v else None})  # fmt: skip
    names = suite(rows) if tasks is None else list(dict.fromkeys(tasks))
    out = {"leaderboard": board, "fast_p": fast_p(rows, tasks=names), "suite": names, "runs": runs}
    if png is not None and runs:
        plot(runs, png)
        out["png"] = str(png)
    return out


def plot(runs: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(1, len(r["best_so_far"]) + 1), r["best_so_far"],
                label=f"{r['task']} #{r['run']} ({r['proposer']})")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("best speedup over baseline (x)")
    ax.set_title("wanka lab: best-so-far")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def format_report(rep: dict) -> str:
    lines = [f"{'task':26s} {'runs':>4s} {'evals':>5s} {'best':>7s} {'vs ref':>7s} "
             f"{'ms':>8s} {'held-out':>8s}"]  # fmt: skip
    for b in rep["leaderboard"]:

        def x(v):
            return f"{v:.2f}x" if v else "-"

        ms = f"{b['best_time_ms']:.2f}" if b["best_time_ms"] else "-"
        lines.append(f"{b['task']:26s} {b['runs']:4d} {b['evaluations']:5d} {x(b['best_speedup']):>7s} "
                     f"{x(b['best_vs_reference']):>7s} {ms:>8s} {x(b['held_out_speedup']):>8s}")  # fmt: skip
    lines.append(
        f"fast_p over {len(rep.get('suite', [])) or len(rep['leaderboard'])} tasks: "
        + "  ".join(f"{k}={v:.2f}" for k, v in rep["fast_p"].items())
    )
    for r in rep["runs"]:
        ms = "  ".join(f"@{m}: {v:.2f}x" for m, v in r["milestones"].items())
        lines.append(f"run {r['run']} {r['task']} ({r['proposer']}, {r['evaluations']}/{r['budget']}"
                     f"{'' if r['finished'] else ', unfinished'}): {ms}")  # fmt: skip
    if rep.get("png"):
        lines.append(f"wrote {rep['png']}")
    return "\n".join(lines)


def export(store: Store, task_name: str, out: Path, backend: str = "lab", priority: int = 5,
           candidate: int | None = None) -> Path:  # fmt: skip
    """Write the task's best held-out-verified candidate (or `candidate`) as a module that
    registers it with the op registry. Priority 5 sits below the hand-written CPU backends
    (10): importing it changes nothing unless it is forced (WANKA_OPS_BACKEND=op=lab) or
    given a higher priority."""
    from wanka.lab.tasks import get_task

    task = get_task(task_name)
    if candidate is not None:
        try:
            rec = store.candidate(candidate)
        except KeyError:
            raise LabError(f"no candidate {candidate} in {store.path}") from None
        if not rec.correct:
            raise LabError(f"candidate {candidate} is not correct ({rec.status})")
    else:
        rec = best_per_task(store).get(task_name, {}).get("verified")
        if rec is None:
            raise LabError(f"no held-out-verified candidate for {task_name} in {store.path}")
    header = [
        f"# Generated by `wanka lab export {task_name}` from {store.path}: candidate {rec.id}",
        f"# (run {rec.run_id}, evaluation {rec.n}), {rec.speedup:.2f}x the baseline on "
        f"{task.timing_shape}; held-out: {rec.held_out_ok} ({rec.held_out_speedup or 0:.2f}x).",
        f"# Importing this module registers backend {backend!r} of op {task.op!r}.",
        f"# Variant: {json.dumps(rec.config)}" if rec.config else "# Variant: (free-form source)",
        "",
    ]
    dev = ("cpu",) if task.device == "cpu" else (task.device,)
    footer = ["", "", "from wanka.ops.registry import register as _lab_register  # noqa: E402", "",
              f"_lab_register({task.op!r}, {backend!r}, device_types={dev!r}, priority={priority})(kernel)", ""]  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + rec.source.rstrip("\n") + "\n".join(footer))
    return out
