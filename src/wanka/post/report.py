"""`wanka report` for `wanka distill` / `wanka rl` / `wanka draft` runs: their metrics.jsonl has
no "val_loss" or "tokens_per_s" but per-domain divergences and held-out losses (with each
teacher's held-out loss as the target), rewards and KL, or the drafter's KL to the main model
and its speculative acceptance, which the pre-training panels cannot show."""

from __future__ import annotations

from pathlib import Path

from wanka.report import _empty, _series, load_metrics

DIVERGENCE = "divergence/"
VAL_LOSS = "val_loss/"
VAL_RKL = "val_reverse_kl/"
TEACHER_EVAL = "teacher_eval"
_RL_TRAIN_KEYS = ("reward", "groups_with_signal", "groups_with_a_reward", "kl_mean",
                  "clip_fraction")  # fmt: skip
ACCEPTANCE = "val_acceptance/"
_DRAFT_EVAL_KEYS = ("val_mtp_kl", "val_mean_acceptance_length")


def _keys(rows: list[dict], prefix: str) -> list[str]:
    """Suffixes of the keys starting with `prefix`, in first-seen order (domain names)."""
    found: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith(prefix):
                found[k[len(prefix) :]] = None
    return list(found)


def is_post_run(train: list[dict], evals: list[dict], events: list[dict]) -> str | None:
    """Which post-training command wrote the rows ("distill", "rl", "draft"), None for
    pre-training: told apart by what each command logs."""
    if any(e.get("kind") == TEACHER_EVAL for e in events):
        return "distill"
    if _keys(train, DIVERGENCE) or _keys(evals, VAL_LOSS):
        return "distill"
    if any(k in r for r in train for k in _RL_TRAIN_KEYS) or any("val_reward" in r for r in evals):
        return "rl"
    if any(k in r for r in evals for k in _DRAFT_EVAL_KEYS) or any(
        "mtp_positions" in r for r in train
    ):
        return "draft"
    return None


def teacher_losses(events: list[dict]) -> dict[str, dict[str, float]]:
    """{teacher: {domain: held-out loss}} from the teacher_eval events (a rerun that logged
    them twice keeps the last)."""
    out: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("kind") == TEACHER_EVAL and "teacher" in e:
            out[str(e["teacher"])] = {
                k[len(VAL_LOSS) :]: float(v)
                for k, v in e.items()
                if k.startswith(VAL_LOSS) and isinstance(v, int | float)
            }
    return out


def gap_closed(start: float, last: float, teacher: float) -> float | None:
    """Fraction of the start-to-teacher gap the student closed; None when the teacher is not
    better than the start (no gap to close, the ratio would mislead)."""
    if not teacher < start:
        return None
    return (start - last) / (start - teacher)


def summarize_post(train: list[dict], evals: list[dict], events: list[dict]) -> list[str]:
    """Text lines: per domain the held-out loss's start, last, best teacher and gap closed
    (distill), or the first and last held-out reward (rl); [] for a pre-training run."""
    kind = is_post_run(train, evals, events)
    lines: list[str] = []
    if kind == "distill":
        teachers = teacher_losses(events)
        for d in _keys(evals, VAL_LOSS):
            xs, ys = _series(evals, VAL_LOSS + d)
            if not ys:
                continue
            text = f"{VAL_LOSS + d:<15}: start {ys[0]:.4f} (step {xs[0]}), last {ys[-1]:.4f} (step {xs[-1]})"  # fmt: skip
            on_d = {t: losses[d] for t, losses in teachers.items() if d in losses}
            if on_d:
                best = min(on_d, key=lambda t: (on_d[t], t != d))  # a tie: the domain's own
                frac = gap_closed(ys[0], ys[-1], on_d[best])
                closed = "n/a" if frac is None else f"{frac:.1%}"
                text += f", best teacher {best} {on_d[best]:.4f}, gap closed {closed}"
            else:
                text += ", no teacher_eval: gap n/a"
            lines.append(text)
        for d in _keys(evals, VAL_RKL):
            xs, ys = _series(evals, VAL_RKL + d)
            if ys:
                lines.append(f"{VAL_RKL + d:<15}: start {ys[0]:.4f} (step {xs[0]}), last {ys[-1]:.4f} (step {xs[-1]})")  # fmt: skip
    elif kind == "rl":
        xs, ys = _series(evals, "val_reward")
        if ys:
            lines.append(f"val_reward     : first {ys[0]:.4f} (step {xs[0]}), last {ys[-1]:.4f} (step {xs[-1]})")  # fmt: skip
        _, rs = _series(train, "reward")
        if rs:
            lines.append(f"train reward   : last {rs[-1]:.4f}")
    elif kind == "draft":
        steps = _keys(evals, "val_mtp_kl_step")  # held-out KL per recursive draft step
        for key in ("val_mtp_kl", *(f"val_mtp_kl_step{k}" for k in steps),
                    "val_mean_acceptance_length", "val_distinct_4grams"):  # fmt: skip
            xs, ys = _series(evals, key)
            if ys:
                lines.append(f"{key:<15}: first {ys[0]:.4f} (step {xs[0]}), last {ys[-1]:.4f} (step {xs[-1]})")  # fmt: skip
        last = {}
        for d in _keys(evals, ACCEPTANCE):
            xs, ys = _series(evals, ACCEPTANCE + d)
            if ys:
                last[d] = f"{d} {ys[-1]:.1%}"
        if last:
            lines.append(f"acceptance     : {', '.join(last.values())} (last eval)")
    return lines


def _line(ax, rows: list[dict], key: str, **kw) -> bool:
    label = kw.pop("label", key)
    xs, ys = _series(rows, key)
    if xs:
        ax.plot(xs, ys, label=label, **kw)
    return bool(xs)


def _twin(ax, rows: list[dict], left: str, right: str) -> None:
    """Two series of different units on one panel: `left` on ax, `right` on a twin axis."""
    drawn = _line(ax, rows, left, color="tab:blue")
    if drawn:
        ax.set_ylabel(left, color="tab:blue")
    xs, ys = _series(rows, right)
    if xs:
        tw = ax.twinx()
        tw.plot(xs, ys, color="tab:red", linewidth=0.9, label=right)
        tw.set_ylabel(right, color="tab:red")
    if not drawn and not xs:
        _empty(ax, f"no {left} / {right} data")


def _distill_panels(axes, train: list[dict], evals: list[dict], events: list[dict]) -> None:
    ax_div, ax_val, ax_gn = axes
    domains = list(dict.fromkeys(_keys(train, DIVERGENCE) + _keys(evals, VAL_LOSS)))
    color = {d: f"C{i % 10}" for i, d in enumerate(domains)}
    # Panel 1: what the step minimised, per domain, and its token mean.
    drawn = [_line(ax_div, train, DIVERGENCE + d, color=color[d], label=f"divergence/{d}") for d in domains]  # fmt: skip
    drawn.append(_line(ax_div, train, "loss", color="black", linewidth=1.6, label="loss (mean)"))
    # The same divergence on held-out prompts (the student's own samples), at each eval.
    drawn += [_line(ax_div, evals, VAL_RKL + d, color=color[d], linestyle="--", marker="o",
                    markersize=4, label=f"held-out {d}") for d in domains]  # fmt: skip
    if any(drawn):
        ax_div.legend(loc="best", fontsize="small")
    else:
        _empty(ax_div, "no divergence data")
    ax_div.set_ylabel("divergence / token")
    # Panel 2: held-out loss per domain against the teachers' (dashed): the gap being closed.
    drawn = [_line(ax_val, evals, VAL_LOSS + d, color=color[d], marker="o", markersize=4) for d in domains]  # fmt: skip
    for t, losses in teacher_losses(events).items():
        for d, v in losses.items():
            own = t == d  # the domain's own teacher is the target; the others are context
            ax_val.axhline(v, color=color.get(d, "gray"), linestyle="--",
                           linewidth=1.2 if own else 0.7, alpha=0.9 if own else 0.5,
                           label=f"teacher {t} on {d}")  # fmt: skip
            drawn.append(True)
    if any(drawn):
        ax_val.legend(loc="best", fontsize="small")
    else:
        _empty(ax_val, "no held-out loss data")
    ax_val.set_ylabel("held-out nats / token")
    # Panel 3: optimiser health.
    _twin(ax_gn, train, "lr", "grad_norm")


def _rl_panels(axes, train: list[dict], evals: list[dict]) -> None:
    ax_rw, ax_kl, ax_loss = axes
    # Panel 1: reward (train per step, eval points) and, on a twin axis, the share of groups
    # with signal (rewards not all equal: a group of equal rewards teaches nothing, whatever
    # their value). Runs from before that metric show groups_with_a_reward (max > 0).
    drawn = _line(ax_rw, train, "reward", color="tab:blue")
    drawn |= _line(ax_rw, evals, "val_reward", color="black", linestyle="--", marker="o", markersize=4)  # fmt: skip
    if drawn:
        ax_rw.legend(loc="upper left", fontsize="small")
    share = "groups_with_signal"
    xs, ys = _series(train, share)
    if not xs:
        share = "groups_with_a_reward"
        xs, ys = _series(train, share)
    if xs:
        tw = ax_rw.twinx()
        tw.plot(xs, ys, color="tab:green", linewidth=0.9, alpha=0.8, label=share)
        tw.set_ylabel(share.replace("_", " "), color="tab:green")
        tw.set_ylim(-0.05, 1.05)
    if not drawn and not xs:
        _empty(ax_rw, "no reward data")
    ax_rw.set_ylabel("reward")
    # Panel 2: how far the update moves the policy: KL to the reference, clipped-ratio share.
    _twin(ax_kl, train, "kl_mean", "clip_fraction")
    # Panel 3: the surrogate loss.
    if not _line(ax_loss, train, "loss", color="black"):
        _empty(ax_loss, "no loss data")
    ax_loss.set_ylabel("loss")


def _draft_panels(axes, train: list[dict], evals: list[dict]) -> None:
    ax_kl, ax_acc, ax_gn = axes
    # Panel 1: the KL the drafter minimises (train, on its own samples: the sum over trained
    # draft steps, and each step's) and on held-out text.
    drawn = _line(ax_kl, train, "loss", color="black", label="loss (sum over draft steps)")
    # Recursive draft steps: from the training rows (held-out KLs need reference prompts).
    found = dict.fromkeys([*_keys(train, "mtp_kl_step"), *_keys(evals, "val_mtp_kl_step")])
    steps = ["", *(f"_step{k}" for k in found)]
    for n, step in enumerate(steps):
        name = f"draft {n + 1}" if len(steps) > 1 else "KL main || MTP"
        if len(steps) > 1:  # one step: the loss is that step's KL
            drawn |= _line(ax_kl, train, "mtp_kl" + step, color=f"C{n}", linewidth=0.8,
                           label=f"{name} (train)")  # fmt: skip
        drawn |= _line(ax_kl, evals, "val_mtp_kl" + step, color=f"C{n}", linestyle="--",
                       marker="o", markersize=4, label=f"{name} (held-out)")  # fmt: skip
    if drawn:
        ax_kl.legend(loc="best", fontsize="small")
    else:
        _empty(ax_kl, "no KL data")
    ax_kl.set_ylabel("KL / position")
    # Panel 2: speculative acceptance per draft position at each eval, and the share of
    # distinct 4-grams (text stuck in a loop is easy to draft: read acceptance against it).
    drawn = [_line(ax_acc, evals, ACCEPTANCE + d, marker="o", markersize=4, label=d)
             for d in _keys(evals, ACCEPTANCE)]  # fmt: skip
    drawn.append(_line(ax_acc, evals, "val_distinct_4grams", color="gray", linestyle=":",
                       label="distinct 4-grams"))  # fmt: skip
    if any(drawn):
        ax_acc.legend(loc="lower right", fontsize="small")
        ax_acc.set_ylim(-0.05, 1.05)
    else:
        _empty(ax_acc, "no acceptance data")
    ax_acc.set_ylabel("acceptance / share")
    xs, ys = _series(evals, "val_mean_acceptance_length")
    if xs:
        tw = ax_acc.twinx()
        tw.plot(xs, ys, color="tab:red", marker="s", markersize=4, label="mean acceptance length")
        tw.set_ylabel("mean acceptance length", color="tab:red")
    # Panel 3: optimiser health.
    _twin(ax_gn, train, "lr", "grad_norm")


def plot_post_curves(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the distill, rl or draft panels of run_dir to RUN_DIR/post_curves.png (or `out`)."""
    # Figure + Agg canvas instead of pyplot, as wanka.report: no display, no global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    events: list[dict] = []
    train, evals = load_metrics(run_dir, events)
    kind = is_post_run(train, evals, events)
    if kind is None:
        raise ValueError(f"{run_dir} is not a wanka distill / rl / draft run")
    out = Path(out) if out is not None else run_dir / "post_curves.png"

    fig = Figure(figsize=(10, 10), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"wanka {kind}: {run_dir.resolve().name}")
    if kind == "distill":
        _distill_panels(axes, train, evals, events)
    elif kind == "draft":
        _draft_panels(axes, train, evals)
    else:
        _rl_panels(axes, train, evals)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
