"""argparse wiring of `wanka lab tasks|run|eval|report|export`. Handlers return an exit code;
bad input raises LabError (a ValueError: one line, exit code 2, from wanka's main)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_DB = "runs/lab/history.sqlite"
UNSAFE_HELP = (
    "run untrusted code even when OS isolation is unavailable here; the candidate then runs "
    "with your user's rights (rlimits and an audit hook only)"
)


def _isolation_unavailable() -> str | None:
    """Why OS isolation of candidates is unavailable here (None when it works)."""
    try:
        from wanka.lab.sandbox import unavailable_reason
    except ImportError as e:
        if e.name == "wanka.lab.sandbox":
            return "wanka.lab.sandbox missing"
        return f"wanka.lab.sandbox does not import: {e}"
    return unavailable_reason()


def _isolation(a: argparse.Namespace, what: str | None) -> None:
    """Refuse to run untrusted code (`what`; None: trusted) without OS isolation unless
    --unsafe-no-isolation. The evaluator isolates whenever it can, flag or not."""
    from wanka.lab.task import LabError

    if a.unsafe_no_isolation:
        return
    why = _isolation_unavailable() if what else None
    if why:
        raise LabError(f"refusing to run {what} without OS isolation ({why}); "
                       "pass --unsafe-no-isolation to run it anyway")  # fmt: skip


def _budget(text: str) -> int:
    from wanka.lab.task import LabError

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise LabError(f"--budget must be a positive integer, got {text!r}")
    return n


def _tasks(a: argparse.Namespace) -> int:
    from wanka.lab.tasks import all_tasks

    for t in all_tasks().values():
        why = t.unavailable()
        size = t.space.size() if t.space else 0
        print(f"{t.name:26s} {t.device:4s} {t.mode:7s} {size:5d} variants  op {t.op:20s}"
              + (f"  [here: {why}]" if why else ""))  # fmt: skip
        if a.verbose:
            print("    " + t.description.replace("\n", "\n    ").rstrip())
            print(f"    shapes: {'; '.join(str(s) for s in t.shapes)}; timed: {t.timing_shape}")
    return 0


def _eval_config(a: argparse.Namespace):
    import math

    from wanka.lab.evaluator import EvalConfig
    from wanka.lab.task import LabError

    # (--memory-gib 0 removed the sandbox's memory limit; --repeats 0 failed every candidate)
    for flag, value, low in (("--timeout", a.timeout, 1.0), ("--memory-gib", a.memory_gib, 0.25),
                             ("--repeats", a.repeats, 1)):  # fmt: skip
        if not math.isfinite(value) or value < low:
            raise LabError(f"{flag} {value} is out of range: use {low:g} or more")
    return EvalConfig(timeout_s=a.timeout, memory_gib=a.memory_gib, repeats=a.repeats)


def _proposer(a: argparse.Namespace):
    from wanka.lab.task import LabError

    if a.proposer == "search":
        from wanka.lab.proposers.search import SearchProposer

        return SearchProposer(seed=a.seed)
    if a.proposer == "llm":
        from wanka.lab.proposers.llm import LLMProposer

        return LLMProposer(a.llm_url, a.llm_model, a.llm_key, temperature=a.temperature)
    raise LabError(f"unknown proposer {a.proposer!r}; have: search, llm")


def _run(a: argparse.Namespace) -> int:
    from wanka.lab.runner import RunConfig, run_task
    from wanka.lab.store import Store
    from wanka.lab.tasks import get_task

    task = get_task(a.task)
    budget = _budget(a.budget)
    why = task.unavailable()
    if why:
        from wanka.lab.task import LabError

        raise LabError(f"task {task.name} cannot be timed here: {why}")
    # The llm proposer's candidates are untrusted code; search renders trusted templates.
    _isolation(a, f"proposer {a.proposer}" if a.proposer == "llm" else None)
    proposer = _proposer(a)
    store = Store(a.db)
    cfg = RunConfig(budget=budget, eval=_eval_config(a), resume=not a.new, run_id=a.resume)
    summary = run_task(task, proposer, store, cfg)
    b = summary["best"]
    print(f"{task.name}: {summary['evaluations']} evaluations, {summary['correct']} correct; best "
          + (f"{b['speedup']:.2f}x (candidate {b['candidate']})" if b else "none")
          + (f"; held-out verified {summary['held_out_speedup']:.2f}x" if summary["verified"]
             else "; no candidate passed the held-out check"))  # fmt: skip
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=1))
        print(f"wrote {a.json}")
    return 0


def _eval(a: argparse.Namespace) -> int:
    from wanka.lab.evaluator import evaluate
    from wanka.lab.tasks import get_task

    task = get_task(a.task)
    src = Path(a.file).read_text()
    _isolation(a, f"candidate file {a.file}")
    fb = evaluate(task, src, _eval_config(a))
    print(json.dumps(fb.to_dict(), indent=1) if a.json_out else fb.summary())
    if fb.correct and a.held_out:
        ho = evaluate(task, src, _eval_config(a), shapes=task.held_out,
                      timing_shape=task.held_out_timing)  # fmt: skip
        print("held-out: " + ho.summary())
        return 0 if ho.correct else 1
    return 0 if fb.correct else 1


def _report(a: argparse.Namespace) -> int:
    from wanka.lab.report import format_report, report
    from wanka.lab.store import Store

    if not Path(a.db).exists():
        raise FileNotFoundError(f"no lab history at {a.db} (run `wanka lab run` first)")
    rep = report(Store(a.db), png=Path(a.png) if a.png else None, tasks=a.tasks)
    print(format_report(rep))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1))
        print(f"wrote {a.json}")
    return 0


def _export(a: argparse.Namespace) -> int:
    from wanka.lab.report import export, read_provenance
    from wanka.lab.store import Store

    if not Path(a.db).exists():
        raise FileNotFoundError(f"no lab history at {a.db} (run `wanka lab run` first)")
    out = Path(a.out or f"runs/lab/export/{a.task.replace('-', '_')}_{a.name}.py")
    path = export(Store(a.db), a.task, out, backend=a.name, priority=a.priority,
                  candidate=a.candidate, recheck=not a.no_recheck, eval_cfg=_eval_config(a))  # fmt: skip
    p = read_provenance(path) or {}
    sp = p.get("held_out_speedup_recheck")
    check = f"held-out re-check {sp:.2f}x" if isinstance(sp, float) else "held-out re-check skipped"
    print(f"wrote {path}: candidate {p.get('candidate')}, {check}; import it to register backend "
          f"{a.name!r} (force it with WANKA_OPS_BACKEND=<op>={a.name})")  # fmt: skip
    return 0


def add_lab_parser(subparsers: argparse._SubParsersAction) -> None:
    """`wanka lab tasks|run|eval|report|export`: the operator laboratory."""
    lab = subparsers.add_parser("lab", help="operator lab: propose, verify and time kernels")
    sub = lab.add_subparsers(dest="lab_cmd", required=True)
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument("--db", default=DEFAULT_DB, help=f"SQLite history (default {DEFAULT_DB})")
    ev = argparse.ArgumentParser(add_help=False)
    ev.add_argument("--timeout", type=float, default=300.0, help="seconds per candidate")
    ev.add_argument("--memory-gib", type=float, default=8.0, help="address-space limit (CPU)")
    ev.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")

    t = sub.add_parser("tasks", help="list the tasks")
    t.add_argument("-v", "--verbose", action="store_true", help="shapes and variant spaces too")
    t.set_defaults(fn=_tasks)

    r = sub.add_parser("run", parents=[db, ev], help="propose -> evaluate -> store, in a budget")
    r.add_argument("task", help="a task name from wanka lab tasks")
    r.add_argument("--proposer", default="search", help="search (offline) | llm")
    r.add_argument("--budget", required=True, help="evaluations (llm: chat calls)")
    r.add_argument("--seed", type=int, default=0, help="proposer seed")
    r.add_argument("--new", action="store_true", help="start a new run, do not resume")
    r.add_argument("--resume", type=int, default=None, metavar="RUN", help="continue this run")
    r.add_argument("--json", default=None, help="write the run summary here")
    r.add_argument("--llm-url", default=None, help="OpenAI-compatible base URL, e.g. "
                   "http://localhost:8000/v1 (env WANKA_LLM_URL)")  # fmt: skip
    r.add_argument("--llm-model", default=None, help="model name (env WANKA_LLM_MODEL)")
    r.add_argument(
        "--llm-key", default=None, help="API key (env WANKA_LLM_API_KEY / OPENAI_API_KEY)"
    )
    r.add_argument(
        "--temperature", type=float, default=0.2, help="llm proposer sampling temperature"
    )
    r.add_argument("--unsafe-no-isolation", action="store_true",
                   help="--proposer llm: " + UNSAFE_HELP)  # fmt: skip
    r.set_defaults(fn=_run)

    e = sub.add_parser("eval", parents=[ev], help="evaluate one candidate file")
    e.add_argument("task", help="a task name from wanka lab tasks")
    e.add_argument("file", help="candidate source file")
    e.add_argument("--held-out", action="store_true", help="also run the held-out check")
    e.add_argument("--json", dest="json_out", action="store_true", help="print the verdict as JSON")
    e.add_argument("--unsafe-no-isolation", action="store_true", help=UNSAFE_HELP)
    e.set_defaults(fn=_eval)

    p = sub.add_parser("report", parents=[db], help="leaderboard, fast_p, best-so-far PNG")
    p.add_argument(
        "--png", default="runs/lab/best_so_far.png", help="where to draw the best-so-far curve"
    )
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--tasks", nargs="+", default=None,
                   help="fast_p suite (default: every task runnable here plus those with runs)")  # fmt: skip
    p.set_defaults(fn=_report)

    x = sub.add_parser("export", parents=[db, ev], help="best candidate -> op registry backend "
                       "module, after checking the record and re-running its held-out check")  # fmt: skip
    x.add_argument("task", help="a task name from wanka lab tasks")
    x.add_argument("--name", default="lab", help="backend name (default lab)")
    x.add_argument(
        "--priority", type=int, default=5, help="registry priority of the exported backend"
    )
    x.add_argument(
        "--candidate", type=int, default=None, help="candidate id (default: best verified)"
    )
    x.add_argument("--out", default=None, help="file to write (default: the op package)")
    x.add_argument("--no-recheck", action="store_true",
                   help="skip re-running the held-out check (for a task that cannot be timed "
                   "here); the record's MAC, source hash and the source policy are still checked")  # fmt: skip
    x.set_defaults(fn=_export)
