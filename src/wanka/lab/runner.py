"""The loop: propose -> evaluate -> store, within a budget; then the held-out check.

Budget = proposals (for `search` each is a new point of the space, for `llm` one chat
call). A run interrupted at any point resumes from the history: the next `wanka lab run`
for the same task and proposer continues the unfinished run. After the budget, the fastest
correct candidates are re-evaluated on the held-out shapes (never shown to the proposer),
best first, until one passes: its held-out speedup is the run's verified result.

Only this (parent) process writes the history: the source's SHA-256 is computed here from
the exact string handed to the evaluator, never taken from the candidate's process; rows
that fail the store's integrity check are never held-out checked, re-signed or reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from wanka.lab.evaluator import EvalConfig, evaluate
from wanka.lab.proposers.base import Proposer
from wanka.lab.store import Record, Store, sha256_text
from wanka.lab.task import LabError, Task


@dataclass(frozen=True)
class RunConfig:
    budget: int
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume: bool = True  # continue the latest unfinished run of this task and proposer
    run_id: int | None = None  # continue this run (even a finished one, to extend it)
    verify_top: int = 3  # candidates tried on the held-out shapes, fastest first


def best(history: list[Record], verified: bool = False) -> Record | None:
    ok = [r for r in history if r.correct and r.speedup and (r.held_out_ok or not verified)]
    return max(ok, key=lambda r: r.speedup, default=None)


def run_task(task: Task, proposer: Proposer, store: Store, cfg: RunConfig,
             log: Callable[[str], None] = print) -> dict:  # fmt: skip
    if cfg.budget < 1:
        raise LabError(f"budget must be at least 1, got {cfg.budget}")
    t0 = time.time()
    # The candidate's sandbox hides the history's folder (database and HMAC key).
    cfg = replace(
        cfg, eval=replace(cfg.eval, hide=(*cfg.eval.hide, str(store.path.resolve().parent)))
    )
    run_id = cfg.run_id
    if run_id is not None:
        run = store.run(run_id)
        if run.task != task.name:
            raise LabError(f"run {run_id} is for task {run.task}, not {task.name}")
        store.set_budget(run_id, cfg.budget)
    elif cfg.resume:
        run_id = store.resumable(task.name, proposer.name)
        if run_id is not None:
            store.set_budget(run_id, cfg.budget)
    if run_id is None:
        run_id = store.start_run(task.name, proposer.name, cfg.budget, {"eval": cfg.eval.__dict__})
    history = store.candidates(run_id)
    if history:
        log(f"resuming run {run_id}: {len(history)} of {cfg.budget} evaluations done")
    while len(history) < cfg.budget:
        # The proposer (an LLM prompt, too) only sees rows this process wrote and signed.
        prop = proposer.propose(task, intact(store, history))
        if prop is None:
            log("proposer has nothing new to try")
            break
        source = prop.source
        digest = sha256_text(source)  # of the very string the evaluator gets
        fb = evaluate(task, source, cfg.eval)
        store.add(run_id, source, prop.config, prop.note, fb, source_sha256=digest)
        history = store.candidates(run_id)
        b = best(history)
        sp = f"{fb.speedup:.2f}x" if fb.correct and fb.speedup else "-"
        log(f"[{len(history)}/{cfg.budget}] {fb.status:12s} {sp:>7s}  best "
            f"{b.speedup if b else 0:.2f}x  {prop.note}"
            + ("" if fb.correct else f"  ({fb.message[:80]})"))  # fmt: skip
    verified = verify_held_out(task, store, history, cfg, log)
    store.finish(run_id)
    history = store.candidates(run_id)
    ok = intact(store, history)
    b, v = best(ok), best(ok, verified=True)
    return {
        "task": task.name, "run_id": run_id, "proposer": proposer.name,
        "evaluations": len(history), "correct": sum(r.correct for r in history),
        "best": _summary(b), "verified": _summary(v) if verified else None,
        "held_out_speedup": v.held_out_speedup if v else None,
        "elapsed_s": round(time.time() - t0, 1),
    }  # fmt: skip


def intact(store: Store, history: list[Record],
           log: Callable[[str], None] | None = None) -> list[Record]:  # fmt: skip
    """The records that pass the store's integrity check (the others are logged)."""
    out = []
    for r in history:
        why = store.verify(r)
        if why is None:
            out.append(r)
        elif log is not None:
            log(f"candidate {r.id} skipped: failed the integrity check: {why}")
    return out


def verify_held_out(task: Task, store: Store, history: list[Record], cfg: RunConfig,
                    log: Callable[[str], None] | None = None) -> bool:  # fmt: skip
    """Held-out check of the fastest intact correct candidates until one passes."""
    ok_rows = (r for r in intact(store, history, log) if r.correct and r.speedup)
    ranked = sorted(ok_rows, key=lambda r: -r.speedup)
    # An independent, longer measurement: the best of many noisy measurements is biased up.
    strict = replace(cfg.eval, repeats=max(cfg.eval.repeats, 9))
    for r in ranked[: cfg.verify_top]:
        if r.held_out_ok is None:
            fb = evaluate(task, r.source, strict, shapes=task.held_out,
                          timing_shape=task.held_out_timing)  # fmt: skip
            store.set_held_out(r.id, fb)
            ok = fb.correct
        else:
            ok = r.held_out_ok
        if ok:
            return True
    return False


def _summary(r: Record | None) -> dict | None:
    if r is None:
        return None
    return {"candidate": r.id, "n": r.n, "speedup": r.speedup, "time_s": r.time_s,
            "baseline_s": r.baseline_s, "reference_s": r.reference_s, "config": r.config,
            "held_out_ok": r.held_out_ok, "held_out_speedup": r.held_out_speedup}  # fmt: skip
