"""The loop: propose -> evaluate -> store, within a budget; then the held-out check.

Budget = proposals (for `search` each is a new point of the space, for `llm` one chat
call). A run interrupted at any point resumes from the history: the next `wanka lab run`
for the same task and proposer continues the unfinished run. After the budget, the fastest
correct candidates are re-evaluated on the held-out shapes (never shown to the proposer),
best first, until one passes: its held-out speedup is the run's verified result.

Only this (parent) process writes the history: the source's SHA-256 is computed here from
the exact string handed to the evaluator, never taken from the candidate's process; rows
that fail the store's integrity check are never held-out checked, re-signed or reported,
and a run whose sequence of evaluations was altered is not continued.

A proposal that is no usable source (not text, not valid UTF-8, a NUL character, over
MAX_SOURCE_BYTES, or one the proposer itself marks rejected, like a malformed model reply)
is recorded as a rejected evaluation with the reason, never evaluated, and the run goes on:
a proposer's bad answer uses up one proposal of the budget, it never stops the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from wanka.lab.evaluator import EvalConfig, Feedback, evaluate
from wanka.lab.proposers.base import Proposal, Proposer
from wanka.lab.store import OLDER, Record, Store, sha256_text
from wanka.lab.task import LabError, Task

MAX_SOURCE_BYTES = 1 << 20  # a candidate file larger than this is rejected unevaluated
KEPT_BYTES = 64 << 10  # how much of a rejected oversized source the history keeps


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
        _continuable(store, run_id)
        store.set_budget(run_id, cfg.budget)
    elif cfg.resume:
        run_id = store.resumable(task.name, proposer.name)
        if run_id is not None:
            _continuable(store, run_id)
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
        source, note, why = usable(prop)
        digest = sha256_text(source)  # of the very string the evaluator gets
        if why:
            fb = Feedback("rejected", why, flags=["proposal"])
        else:
            fb = evaluate(task, source, cfg.eval)
        store.add(run_id, source, prop.config, note, fb, source_sha256=digest)
        history = store.candidates(run_id)
        b = best(intact(store, history))
        sp = f"{fb.speedup:.2f}x" if fb.correct and fb.speedup else "-"
        log(f"[{len(history)}/{cfg.budget}] {fb.status:12s} {sp:>7s}  best "
            f"{b.speedup if b else 0:.2f}x  {note}"
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


def _continuable(store: Store, run_id: int) -> None:
    """Refuse to extend a run whose record or sequence of evaluations does not verify."""
    why = store.audit(run_id).problem
    if why:
        what = "cannot be continued" if why.startswith(OLDER) else "failed the integrity check"
        raise LabError(f"run {run_id} {what}: {why}; start a new run (wanka lab run --new)")


def _text(x) -> str:
    """x as storable, printable text: what is not valid UTF-8 is backslash-escaped."""
    s = x if isinstance(x, str) else ""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def usable(prop: Proposal) -> tuple[str, str, str]:
    """(source to record, note to record, why the proposal cannot be evaluated or "").
    The source and note returned are always valid UTF-8 text; the source is the proposal's
    own, unchanged, whenever the reason is empty."""
    note = _text(getattr(prop, "note", "")).replace("\n", " ")
    src = getattr(prop, "source", None)
    if not isinstance(src, str):
        return "", note, f"proposer returned no text (a {type(src).__name__})"
    text = _text(src)
    why = getattr(prop, "rejected", "")
    why = _text(why).replace("\n", " ") if isinstance(why, str) else "rejected by the proposer"
    if not why and text != src:
        bad = next(i for i, ch in enumerate(src) if 0xD800 <= ord(ch) <= 0xDFFF)
        why = f"not valid UTF-8 text (a lone surrogate at character {bad})"
    if not why and "\0" in src:
        why = f"source contains a NUL character (at character {src.index(chr(0))})"
    size = len(text.encode("utf-8"))
    if not why and size > MAX_SOURCE_BYTES:
        why = f"source is {size} bytes, over the {MAX_SOURCE_BYTES} byte limit"
    if size > MAX_SOURCE_BYTES:
        text = text.encode("utf-8")[:KEPT_BYTES].decode("utf-8", "ignore")
    return (text, note, why) if why else (src, note, "")


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
