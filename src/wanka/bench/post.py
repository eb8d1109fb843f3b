"""`wanka bench post`: the post-training targets, measured side by side from one base run.

1. base: `wanka train` on the built-in corpus (both domains).
2. teachers: `wanka sft` from the base on one domain each (corpus continuations of code
   prompts, of prose prompts).
3. students from the same base, the same prompts, steps, completion length and eval: MOPD
   (each domain's own teacher, on-policy reverse KL), single-teacher on-policy distillation
   (one teacher for every prompt, once per teacher), mixed off-policy distillation (the same
   two teachers scoring the corpus continuations: GKD with lambda = 0) and supervised
   fine-tuning on teacher samples (sequence-level distillation), the last run longer so that
   the compute it needs to reach MOPD's loss can be read off.
4. `wanka rl` from the base with a built-in reward (default the graded `python_lines`),
   several seeds, each judged on twice the students' held-out prompts (a rate is noisier than
   a loss).

Every phase is a real CLI run in OUT/<phase>; a finished phase is reused when the bench is
run again (delete its directory to redo it). The summary reads each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from wanka.post.report import gap_closed
from wanka.post.rewards import load_reward


@dataclass(frozen=True)
class PostBenchPlan:
    base_steps: int = 300
    teacher_steps: int = 200
    student_steps: int = 200
    sft_factor: int = 4  # the SFT baseline runs this many times the students' steps
    single_teachers: str = "code"  # single-teacher baselines to run ("code,prose": both)
    # MOPD's divergences: "mopd" is reverse KL (the default of `wanka distill`); each other
    # one runs as mopd_<divergence> (GKD's forward KL on the student's own samples).
    mopd_divergences: str = "reverse_kl,forward_kl"
    rl_steps: int = 80
    rl_seeds: int = 3  # 0: no RL phases
    rl_reward: str = "python_lines"  # graded: the tiny base never earns python_parses
    prompts_per_step: int = 8
    eval_every: int = 10
    eval_prompts: int = 32
    lr: float = 1e-3

    @classmethod
    def quick(cls) -> PostBenchPlan:  # the plumbing only: seconds, not a measurement
        return cls(base_steps=4, teacher_steps=2, student_steps=2, sft_factor=2, rl_steps=2,
                   rl_seeds=2, prompts_per_step=2, eval_every=1, eval_prompts=2)  # fmt: skip


def add_bench_post_parser(b) -> None:
    p = b.add_parser("post", help="post-training targets: MOPD vs single-teacher, off-policy "
                     "and SFT distillation at equal compute; RL over seeds")  # fmt: skip
    p.add_argument("--out", default=None, help="directory for the runs + JSON (default "
                   "runs/bench/post, or runs/bench/post-quick with --quick)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the plumbing")
    for name, value in asdict(PostBenchPlan()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"default {value}")  # fmt: skip
    p.set_defaults(fn=run_bench_post)


MOPD_DIVERGENCES = ("reverse_kl", "forward_kl")


def mopd_runs(plan: PostBenchPlan) -> dict[str, str]:
    """{run name: divergence} of the MOPD students; reverse KL's run is plain "mopd"."""
    divs = [x.strip() for x in plan.mopd_divergences.split(",") if x.strip()]
    return {"mopd" if d == "reverse_kl" else f"mopd_{d}": d for d in divs}


def check_plan(plan: PostBenchPlan) -> None:
    for name, value in asdict(plan).items():
        if isinstance(value, int | float) and not value > 0 and name != "rl_seeds":
            raise ValueError(f"--{name.replace('_', '-')}={value}: must be > 0")
    if plan.rl_seeds < 0:
        raise ValueError(f"--rl-seeds={plan.rl_seeds}: must be >= 0 (0 runs no RL)")
    divs = set(mopd_runs(plan).values())
    if "reverse_kl" not in divs or divs - set(MOPD_DIVERGENCES):
        raise ValueError(f"--mopd-divergences={plan.mopd_divergences!r}: a list of "
                         f"{', '.join(MOPD_DIVERGENCES)} that includes reverse_kl (the "
                         "reference every other run is measured against)")  # fmt: skip
    try:
        load_reward(plan.rl_reward)
    except ValueError as e:
        raise ValueError(f"--rl-reward: {e}") from None
    bad = {x.strip() for x in plan.single_teachers.split(",") if x.strip()} - {"code", "prose"}
    if bad:
        raise ValueError(f"--single-teachers names {sorted(bad)}: the teachers are code, prose")


def _config(name: str) -> str:
    """configs/NAME.toml of this checkout (the bench may run from any directory)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / "configs" / name).is_file():
            return str(root / "configs" / name)
    raise ValueError(f"configs/{name} not found: run wanka bench post from the wanka checkout")


def _phase(run: Path, steps: int, args: list[str], log: Path) -> None:
    """Runs `wanka ARGS` into `run` unless a finished run with the same inputs is there (an
    unfinished one resumes). A run with other inputs (an earlier plan, --quick) is refused:
    its numbers would mix into this bench's. Inputs are recorded relative to the bench's
    directory, so finished phases can be copied into another bench's (e.g. a longer plan
    that shares the base and the teachers)."""
    inputs = json.dumps([a.replace(str(run.parent), "{out}") for a in args])
    stamp = run / "bench_inputs.json"
    if run.exists():
        if not stamp.is_file() or stamp.read_text() != inputs:
            raise ValueError(f"{run} holds a run with other inputs than this bench's: delete it "
                             "(and the phases after it) or pass another --out")  # fmt: skip
        if _done(run, steps):
            return
    run.mkdir(parents=True, exist_ok=True)
    stamp.write_text(inputs)
    _wanka(*args, log=log)


def _wanka(*args: str, log: Path) -> None:
    """One CLI run; its output goes to `log`; a failure stops the bench with the log's tail."""
    cmd = [sys.executable, "-m", "wanka", *args]
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:  # the phase's own last lines, then one line saying which phase and where
        print(log.read_text()[-2000:], file=sys.stderr)
        raise ValueError(f"`wanka {' '.join(args[:2])}` failed (exit {rc}); output in {log}")


def _sets(**kv) -> list[str]:
    return sum((["--set", f"{k.replace('__', '.')}={v}"] for k, v in kv.items()), [])


def _done(run: Path, steps: int) -> bool:
    return (run / "checkpoints" / f"step-{steps:08d}").is_dir()


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def at_tokens(points: list[dict], tokens: float, domains: list[str]) -> dict | None:
    """Each domain's held-out loss interpolated linearly at `tokens` processed; None when the
    run stopped before."""
    for a, b in zip(points, points[1:]):
        if a["tokens"] <= tokens <= b["tokens"]:
            w = (tokens - a["tokens"]) / max(b["tokens"] - a["tokens"], 1e-9)
            return {d: a[d] + w * (b[d] - a[d]) for d in domains}
    if points and abs(points[-1]["tokens"] - tokens) <= 1e-6 * max(tokens, 1.0):
        return {d: points[-1][d] for d in domains}
    return None


def curve(run: Path, key_prefix: str = "val_loss/") -> list[dict]:
    """Per eval: step, cumulative tokens processed by then, and every `key_prefix` value."""
    rows = _rows(run)
    spent, cum = 0.0, {0: 0.0}
    for r in sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"]):
        spent += float(r.get("tokens_processed", 0.0))
        cum[r["step"]] = spent
    out = []
    for r in rows:
        if r["kind"] == "eval":
            vals = {k[len(key_prefix) :]: v for k, v in r.items() if k.startswith(key_prefix)}
            if vals:
                out.append({"step": r["step"], "tokens": cum.get(r["step"], spent), **vals})
    return out


def teacher_losses(run: Path) -> dict[str, dict[str, float]]:
    out = {}
    for r in _rows(run):
        if r.get("kind") == "teacher_eval":
            out[r["teacher"]] = {k[9:]: v for k, v in r.items() if k.startswith("val_loss/")}
    return out


def tokens_to_reach(points: list[dict], domains: list[str], target: float) -> float | None:
    """Tokens processed at the first eval whose mean held-out loss over `domains` <= target."""
    for p in points:
        if statistics.fmean(p[d] for d in domains) <= target:
            return p["tokens"]
    return None


def summarize(out: Path, plan: PostBenchPlan) -> dict:
    # The plan's runs only: a directory another plan left in `out` is not this bench's.
    singles = [f"single_{d.strip()}" for d in plan.single_teachers.split(",") if d.strip()]
    planned = [*mopd_runs(plan), *singles, "offpolicy_mixed", "sft_teacher_samples"]
    students = {name: curve(out / name) for name in planned if (out / name).is_dir()}
    teachers = teacher_losses(out / "mopd")
    domains = sorted(teachers["code"])
    start = students["mopd"][0]
    best = {d: min(t[d] for t in teachers.values()) for d in domains}
    runs = {}
    equal_tokens = students["mopd"][-1]["tokens"]
    for name, points in students.items():
        # Equal compute: the held-out loss interpolated at MOPD's total compute.
        at = at_tokens(points, equal_tokens, domains)
        runs[name] = {
            "tokens_processed": equal_tokens if at else points[-1]["tokens"],
            "reached_equal_compute": at is not None,
            "val_loss": at or {d: points[-1][d] for d in domains},
            "final": {"step": points[-1]["step"], "tokens_processed": points[-1]["tokens"],
                      **{d: points[-1][d] for d in domains}},
            "curve": points,
        }  # fmt: skip
        v = runs[name]["val_loss"]
        runs[name]["gap_closed"] = {d: gap_closed(start[d], v[d], best[d]) for d in domains}
        # Distillation runs also log KL(student || teacher) on the student's own held-out
        # samples (what on-policy distillation minimises): at equal compute too.
        rkl = curve(out / name, "val_reverse_kl/")
        if rkl and all(d in rkl[0] for d in domains):
            runs[name]["reverse_kl"] = at_tokens(rkl, equal_tokens, domains) or {
                d: rkl[-1][d] for d in domains
            }  # fmt: skip
    # Compute each run needs to reach an on-policy run's loss (its mean over the domains at
    # equal compute), and SFT's over the on-policy run's: the ">= 2x less compute".
    compute_to = {}
    for name in (n for n in students if n.startswith("mopd")):
        target = statistics.fmean(runs[name]["val_loss"][d] for d in domains)
        reach = {n: tokens_to_reach(points, domains, target) for n, points in students.items()}
        own, sft_at = reach.get(name), reach.get("sft_teacher_samples")
        ratio = sft_at / own if own and sft_at is not None else None
        compute_to[name] = {"target_mean_val_loss": target, "tokens": reach, "sft_over_run": ratio}
        # SFT ran out before the target: its whole compute is a lower bound on the ratio.
        sft = students.get("sft_teacher_samples")
        if own and sft and sft_at is None:
            compute_to[name]["sft_over_run_at_least"] = sft[-1]["tokens"] / own
    rl = {}
    for seed in range(plan.rl_seeds):
        pts = curve(out / f"rl-seed{seed}", "val_")
        rl[seed] = {"start": pts[0]["reward"], "final": pts[-1]["reward"], "curve": pts}
    finals = [v["final"] for v in rl.values()]
    mopd = compute_to["mopd"]
    return {
        "student_start": {d: start[d] for d in domains},
        "teachers": teachers,
        "best_teacher": best,
        "runs": runs,
        "compute_to_mopd_loss": {
            "target_mean_val_loss": mopd["target_mean_val_loss"],
            "tokens": mopd["tokens"],
            "sft_over_mopd": mopd["sft_over_run"],
        },  # fmt: skip
        "compute_to_loss": compute_to,
        "rl": None
        if not rl
        else {
            "reward": plan.rl_reward,
            "seeds": rl,
            "start": statistics.fmean(v["start"] for v in rl.values()),
            "final_mean": statistics.fmean(finals),
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        },  # fmt: skip
    }


# Forward-token equivalents per step, relative to MOPD's, for runs that skip sampling: they run
# this many more steps so that their curve reaches MOPD's compute (read off by interpolation).
CHEAPER_STEPS = {"offpolicy_mixed": 1.25}


def run_bench_post(args: argparse.Namespace) -> int:
    plan = PostBenchPlan.quick() if args.quick else PostBenchPlan()
    given = {k: getattr(args, k) for k in asdict(plan) if getattr(args, k, None) is not None}
    plan = PostBenchPlan(**{**asdict(plan), **given})
    check_plan(plan)
    out = Path(args.out or ("runs/bench/post-quick" if args.quick else "runs/bench/post"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    common = dict(run__tensorboard="false", resilience__supervise="false",
                  resilience__snapshot_every=0, parallel__ep=1)  # fmt: skip
    base = out / "base"
    _phase(base, plan.base_steps,
           ["train", _config("demo.toml"), "--nproc", "1",
            *_sets(run__dir=base, train__steps=plan.base_steps, train__eval_every=10**6,
                   checkpoint__every=plan.base_steps, **common)], out / "base.log")  # fmt: skip
    # Every post run draws the same prompts (post.prompt_seed), whatever its train.seed.
    post = dict(post__init=base, post__prompts_per_step=plan.prompts_per_step,
                post__eval_prompts=plan.eval_prompts, post__prompt_seed=0, train__lr=plan.lr,
                train__warmup_steps=5, train__eval_every=plan.eval_every, **common)  # fmt: skip

    def run(name: str, cmd: str, steps: int, **extra) -> None:
        config = _config("sft.toml" if cmd == "sft" else f"{cmd}.toml")
        sets = _sets(**{**post, **extra, "run__dir": out / name, "train__steps": steps,
                        "checkpoint__every": steps})  # fmt: skip
        _phase(out / name, steps, [cmd, config, "--nproc", "1", *sets], out / f"{name}.log")
        print(f"bench post: {name} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    for d in ("code", "prose"):
        run(f"teacher-{d}", "sft", plan.teacher_steps, post__domains=d,
            train__eval_every=plan.teacher_steps)  # fmt: skip
    teacher = {d: out / f"teacher-{d}" for d in ("code", "prose")}
    both = f"code={teacher['code']},prose={teacher['prose']}"
    S = plan.student_steps
    for name, div in mopd_runs(plan).items():
        extra = {} if div == "reverse_kl" else {"post__divergence": div}
        run(name, "distill", S, post__teachers=both, **extra)
    for d in (x.strip() for x in plan.single_teachers.split(",") if x.strip()):
        run(f"single_{d}", "distill", S, post__teachers=f"code={teacher[d]},prose={teacher[d]}")
    # SFT (the compute target's baseline) before the off-policy baseline.
    run("sft_teacher_samples", "sft", S * plan.sft_factor, post__teachers=both,
        post__sft_source="teachers")  # fmt: skip
    run("offpolicy_mixed", "distill", round(S * CHEAPER_STEPS["offpolicy_mixed"]),
        post__teachers=both, post__on_policy_fraction=0.0, post__divergence="forward_kl")  # fmt: skip
    for seed in range(plan.rl_seeds):
        run(f"rl-seed{seed}", "rl", plan.rl_steps, train__seed=seed, post__reward=plan.rl_reward,
            post__eval_prompts=2 * plan.eval_prompts,
            post__prompts_per_step=max(1, plan.prompts_per_step // 2), post__samples_per_prompt=4)  # fmt: skip
    result = {"plan": asdict(plan), "wall_s": time.perf_counter() - t0, **summarize(out, plan)}
    (out / "post.json").write_text(json.dumps(result, indent=1))
    for line in table(result):
        print(line)
    print(f"wrote {out / 'post.json'}")
    return 0


def table(result: dict) -> list[str]:
    domains = sorted(result["best_teacher"])
    lines = ["student start: " + ", ".join(f"{d} {result['student_start'][d]:.4f}" for d in domains),
             "teachers (held-out loss per domain): " + "; ".join(
                 f"{t}: " + ", ".join(f"{d} {v:.4f}" for d, v in sorted(ls.items()))
                 for t, ls in sorted(result["teachers"].items())),
             "| run | compute (fwd-token equiv.) | "
             + " | ".join(f"{d} loss | {d} gap closed" for d in domains) + " | steps run |",
             "|---|---|" + "---|---|" * len(domains) + "---|"]  # fmt: skip
    for name, r in result["runs"].items():
        cells = []
        for d in domains:
            g = r["gap_closed"][d]
            cells += [f"{r['val_loss'][d]:.4f}", "n/a" if g is None else f"{g:.1%}"]
        short = "" if r["reached_equal_compute"] else " (stopped short)"
        lines.append(f"| {name} | {r['tokens_processed']:.0f}{short} | " + " | ".join(cells)
                     + f" | {r['final']['step']} |")  # fmt: skip
    for name, r in result["runs"].items():
        if "reverse_kl" in r:
            lines.append(f"{name}: held-out KL(student || teacher) on its own samples: "
                         + ", ".join(f"{d} {r['reverse_kl'][d]:.4f}" for d in domains))  # fmt: skip
    for name, c in result["compute_to_loss"].items():
        lines.append(f"compute to reach {name}'s mean held-out loss {c['target_mean_val_loss']:.4f}: "
                     + ", ".join(f"{k} {'not reached' if v is None else f'{v:.0f}'}" for k, v in c["tokens"].items())
                     + (f"; SFT / {name} = {c['sft_over_run']:.2f}x" if c["sft_over_run"] else "")
                     + (f"; SFT / {name} > {c['sft_over_run_at_least']:.2f}x (SFT stopped first)"
                        if "sft_over_run_at_least" in c else ""))  # fmt: skip
    rl = result["rl"]
    if rl is None:
        lines.append("rl: not run (--rl-seeds 0)")
        return lines
    lines.append(f"rl held-out reward ({rl.get('reward', 'python_parses')}): start {rl['start']:.3f}, final {rl['final_mean']:.3f} "
                 f"+- {rl['final_std']:.3f} over {len(rl['seeds'])} seeds ("
                 + ", ".join(f"{v['final']:.3f}" for v in rl["seeds"].values()) + ")")  # fmt: skip
    return lines
