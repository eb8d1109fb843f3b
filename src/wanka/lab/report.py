"""`wanka lab report`: leaderboard, speedup over time, fast_p across tasks, a PNG of the
best-so-far curves, and export of a task's best candidate as an op-registry backend.

fast_p (KernelBench): the fraction of the suite's tasks whose candidate is correct and more
than p times faster than the baseline. The suite is every registered task runnable on this
device plus any task with runs in the history (or the list given); a task without a correct
run counts as a miss. Here "correct" means it also passed the held-out check, and its speedup
is the smaller of the visible and held-out measurements.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pprint
import tempfile
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from wanka.lab.evaluator import EvalConfig, Feedback, evaluate
from wanka.lab.policy import check_source
from wanka.lab.store import OLDER, Record, Store, sha256_text
from wanka.lab.task import LabError, Task

P_VALUES = (0.0, 1.0, 1.5, 2.0, 3.0)
MILESTONES = (1, 5, 10, 25, 50, 100, 200, 500, 1000)


def _final_speedup(r: Record) -> float | None:
    if not r.held_out_ok or not r.speedup:
        return None
    return min(r.speedup, r.held_out_speedup or r.speedup)


def best_per_task(store: Store) -> dict[str, dict]:
    """Per task, over all its runs: the best candidate, and the best verified one (held-out
    check passed and the record intact). Records failing the integrity check are counted in
    "tampered" ("unverifiable" for the older history format) and never picked."""
    out: dict[str, dict] = {}
    for run in store.runs():
        hist = store.candidates(run.id)
        reasons = store.audit(run.id).reasons
        row = out.setdefault(run.task, {"task": run.task, "runs": 0, "evaluations": 0,
                                        "best": None, "verified": None, "tampered": 0,
                                        "unverifiable": 0})  # fmt: skip
        row["runs"] += 1
        row["evaluations"] += len(hist)
        for r in hist:
            why = reasons.get(r.id, "not in its run")
            if why is not None:
                row["unverifiable" if why.startswith(OLDER) else "tampered"] += 1
                continue
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


def curve(hist: list[Record], skip: frozenset[int] = frozenset()) -> list[float]:
    """Best-so-far speedup after each evaluation of `hist` (0 until something is correct);
    records in `skip` (failed the integrity check) hold their place but never count."""
    best, out = 0.0, []
    for r in hist:
        if r.correct and r.speedup and r.id not in skip:
            best = max(best, r.speedup)
        out.append(best)
    return out


def report(store: Store, png: Path | None = None, tasks=None) -> dict:
    """tasks: the fast_p suite (default: every task runnable here plus those with runs)."""
    rows = best_per_task(store)
    runs = []
    for run in store.runs():
        hist = store.candidates(run.id)
        audit = store.audit(run.id)
        bad = frozenset(i for i, why in audit.reasons.items() if why is not None)
        # The curve walks the run's signed evaluations in their signed order; a run whose
        # sequence was altered (rows deleted, duplicated, reordered, moved) has none to draw.
        c = [] if audit.problem else curve(list(audit.chain), bad)
        ref = [r.reference_s / r.time_s for r in hist
               if r.correct and r.time_s and r.reference_s and r.id not in bad]  # fmt: skip
        runs.append({"run": run.id, "task": run.task, "proposer": run.proposer,
                     "evaluations": len(hist), "budget": run.budget,
                     "finished": run.finished is not None, "best_so_far": c,
                     "best_vs_reference": max(ref, default=None),
                     "milestones": {m: c[m - 1] for m in MILESTONES if m <= len(c)},
                     "integrity": audit.problem})  # fmt: skip
    board = []
    for row in sorted(rows.values(), key=lambda r: r["task"]):
        b, v = row["best"], row["verified"]
        board.append({"task": row["task"], "runs": row["runs"], "evaluations": row["evaluations"],
                      "best_speedup": b.speedup if b else None,
                      "best_vs_reference": (b.reference_s / b.time_s) if b and b.reference_s else None,
                      "best_time_ms": b.time_s * 1e3 if b else None, "candidate": b.id if b else None,
                      "verified_candidate": v.id if v else None,
                      "held_out_speedup": v.held_out_speedup if v else None,
                      "integrity_failures": row["tampered"],
                      "unverifiable": row["unverifiable"]})  # fmt: skip
    names = suite(rows) if tasks is None else list(dict.fromkeys(tasks))
    out = {"leaderboard": board, "fast_p": fast_p(rows, tasks=names), "suite": names, "runs": runs}
    drawn = [r for r in runs if r["best_so_far"]]  # not the runs left out for integrity
    if png is not None and drawn:
        plot(drawn, png)
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
    bad = sum(b.get("integrity_failures", 0) for b in rep["leaderboard"])
    if bad:
        lines.append(f"{bad} records failed the integrity check and were left out "
                     "(written, edited or moved outside wanka lab)")  # fmt: skip
    old = sum(b.get("unverifiable", 0) for b in rep["leaderboard"])
    if old:
        lines.append(f"{old} records are unverifiable (older format) and were left out: "
                     "re-run them")  # fmt: skip
    for r in rep["runs"]:
        why = r.get("integrity")
        if why and why.startswith(OLDER):
            ms = f"{why}; left out"
        elif why:
            ms = f"failed the integrity check: {why}; its best-so-far is left out"
        else:
            ms = "  ".join(f"@{m}: {v:.2f}x" for m, v in r["milestones"].items())
        lines.append(f"run {r['run']} {r['task']} ({r['proposer']}, {r['evaluations']}/{r['budget']}"
                     f"{'' if r['finished'] else ', unfinished'}): {ms}")  # fmt: skip
    if rep.get("png"):
        lines.append(f"wrote {rep['png']}")
    return "\n".join(lines)


def export(store: Store, task_name: str, out: Path, backend: str = "lab", priority: int = 5,
           candidate: int | None = None, recheck: bool = True,
           eval_cfg: EvalConfig | None = None, task: Task | None = None) -> Path:  # fmt: skip
    """Write the task's best held-out-verified candidate (or `candidate`) as a module that
    registers it with the op registry. Priority 5 sits below the hand-written CPU backends
    (10): importing it changes nothing unless it is forced (WANKA_OPS_BACKEND=op=lab) or
    given a higher priority.

    The history is not trusted on its word: the record must pass the store's integrity check
    (MAC and source hash), the source the static policy, and, unless recheck=False (for a
    task that cannot be timed here), the held-out check is run again now in the evaluator.
    Nothing is written unless all pass. `task` overrides the registered task (tests)."""
    from wanka.lab.tasks import get_task

    task = task or get_task(task_name)
    rec = _pick(store, task_name, candidate)
    why = store.verify(rec)
    if why:
        raise LabError(f"candidate {rec.id} failed the integrity check: {why}; "
                       "re-run it with wanka lab eval")  # fmt: skip
    digest = sha256_text(rec.source)  # again here: this exact text is what gets written
    if digest != rec.source_sha256:
        raise LabError(f"candidate {rec.id} failed the integrity check: source hash mismatch")
    bad = check_source(rec.source)
    if bad:
        raise LabError(f"candidate {rec.id} breaks the source policy: {bad[0]}")
    ho = None
    if recheck:
        gone = task.unavailable()
        if gone:
            raise LabError(f"cannot re-check candidate {rec.id} here: task {task.name} "
                           f"{gone}; pass --no-recheck to export on the history's word")  # fmt: skip
        cfg = eval_cfg or EvalConfig()
        cfg = replace(cfg, hide=(*cfg.hide, str(store.path.resolve().parent)))
        ho = evaluate(task, rec.source, cfg, shapes=task.held_out,
                      timing_shape=task.held_out_timing)  # fmt: skip
        if not ho.correct:
            msg = (ho.message or "").strip().splitlines()
            raise LabError(f"candidate {rec.id} failed the held-out re-check: {ho.status}"
                           + (f": {msg[0][:200]}" if msg else ""))  # fmt: skip
    prov = _provenance(store, task, rec, digest, ho, recheck, backend, priority)
    text = _module_text(task, rec, prov, backend, priority)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a failure part way leaves no half module that could be imported.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a module is meant to be read and shared
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _pick(store: Store, task_name: str, candidate: int | None) -> Record:
    """The candidate to export: the given one, else the task's best held-out-passed one by
    its recorded speedup. Integrity is checked by the caller, not here, so that a forged
    "best" stops the export loudly instead of being passed over in silence."""
    if candidate is not None:
        try:
            rec = store.candidate(candidate)
        except KeyError:
            raise LabError(f"no candidate {candidate} in {store.path}") from None
        if store.task_of(rec.run_id) != task_name:
            raise LabError(f"candidate {candidate} is not a {task_name} candidate")
        why = store.verify(rec)  # before reading its verdict: a tampered one means nothing
        if why:
            raise LabError(f"candidate {rec.id} failed the integrity check: {why}; "
                           "re-run it with wanka lab eval")  # fmt: skip
        if not rec.correct:
            raise LabError(f"candidate {candidate} is not correct ({rec.status})")
        return rec
    best = None
    for run in store.runs(task_name):
        for r in store.candidates(run.id):
            f = _final_speedup(r)
            if f is not None and (best is None or f > _final_speedup(best)):
                best = r
    if best is None:
        raise LabError(f"no held-out-verified candidate for {task_name} in {store.path}")
    return best


def _provenance(store: Store, task: Task, rec: Record, digest: str, ho: Feedback | None,
                recheck: bool, backend: str, priority: int) -> dict:  # fmt: skip
    import wanka

    return {
        "task": task.name, "op": task.op, "backend": backend, "priority": priority,
        "db": str(store.path.resolve()), "run_id": rec.run_id, "candidate": rec.id,
        "evaluation": rec.n, "source_sha256": digest,
        "timing_shape": str(task.timing_shape), "speedup": rec.speedup, "time_s": rec.time_s,
        "baseline_s": rec.baseline_s, "held_out_shape": str(task.held_out_timing),
        "held_out_speedup_history": rec.held_out_speedup,
        "held_out_recheck": "passed" if ho is not None else "skipped (--no-recheck)",
        "held_out_speedup_recheck": ho.speedup if ho is not None else None,
        "held_out_time_s_recheck": ho.time_s if ho is not None else None,
        "exported_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "wanka_version": getattr(wanka, "__version__", None), "config": rec.config,
    }  # fmt: skip


def _plain(v):
    """Values a Python literal can hold and ast.literal_eval reads back (no inf/nan)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, bool | int | str) else str(v)


def _module_text(task: Task, rec: Record, prov: dict, backend: str, priority: int) -> str:
    prov = _plain(prov)
    literal = pprint.pformat(prov, sort_dicts=False, width=96)
    if ast.literal_eval(literal) != prov:  # only literals: reading it back runs nothing
        raise LabError("provenance does not round-trip as a Python literal")

    def x(v):
        return f"{v:.2f}x" if isinstance(v, float) else "-"

    def sec(v):
        return f"{v:.6g} s" if isinstance(v, float) else "-"

    # Every value reaches the comments through json.dumps: no newline can end a comment.
    j = json.dumps
    header = [
        f"# Generated by `wanka lab export {task.name}`: candidate {rec.id} of {j(prov['db'])}",
        f"# (run {rec.run_id}, evaluation {rec.n}); record MAC and source hash verified.",
        f"# Task {j(task.name)}, op {j(task.op)}; source sha256 {prov['source_sha256']}.",
        f"# Timing shape {j(prov['timing_shape'])}: {x(prov['speedup'])} the baseline "
        f"({sec(prov['time_s'])} vs {sec(prov['baseline_s'])}).",
        f"# Held-out {j(prov['held_out_shape'])}: {x(prov['held_out_speedup_history'])} in the "
        f"history; re-check {prov['held_out_recheck']}, {x(prov['held_out_speedup_recheck'])}.",
        f"# Exported {prov['exported_utc']} by wanka {j(prov['wanka_version'])}.",
        f"# Variant: {j(rec.config)}" if rec.config else "# Variant: (free-form source)",
        f"# Importing this module registers backend {j(backend)} of op {j(task.op)}.",
        "",
    ]
    dev = ("cpu",) if task.device == "cpu" else (task.device,)
    # PROVENANCE goes after the source: a `from __future__` import must stay first.
    # The lab times and checks attention kernels with as many queries as keys; under context
    # parallelism the model also calls them with a query suffix, which they must decline.
    attn = task.op in ("dense_attention", "sparse_attention", "lightning_indexer", "indexer_kl")
    imports = "register as _lab_register" + (", query_suffix_unsupported" if attn else "")
    supports = ", supports=query_suffix_unsupported" if attn else ""
    footer = ["", "", f"PROVENANCE = {literal}", "",
              f"from wanka.ops.registry import {imports}  # noqa: E402", "",
              f"_lab_register({task.op!r}, {backend!r}, device_types={dev!r}, priority={priority}"
              f"{supports})(kernel)", ""]  # fmt: skip
    return "\n".join(header) + rec.source.rstrip("\n") + "\n".join(footer)


def read_provenance(path: Path) -> dict | None:
    """The PROVENANCE dict of an exported module, read with ast: without importing it, so
    without running the candidate's code."""
    tree = ast.parse(Path(path).read_text())
    found = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PROVENANCE" for t in node.targets
        ):
            found = ast.literal_eval(node.value)  # the last assignment wins, as on import
    return found
