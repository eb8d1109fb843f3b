"""`wanka bench cp` results: per-layout summaries, the cost-model fit, Markdown tables, PNGs.

Pure functions of the records bench/cp_worker.py returns: {layout: [per step: [per rank:
{wall_s, compute_s, plan_s, tokens, terms}]]}.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wanka.distributed.cp_cost import CostModel

LAYOUTS = ("contiguous", "head_tail", "dynamic")
# What the issue asks of dynamic (compute-bound tokens/s ratios, mean imbalance).
TARGETS = {"vs_contiguous": 1.3, "vs_head_tail": 1.1, "imbalance": 1.10}


def _arr(steps: list[list[dict]], key: str) -> np.ndarray:
    """[steps, ranks] of one field."""
    return np.array([[r[key] for r in s] for s in steps], dtype=np.float64)


def summarise_layout(steps: list[list[dict]], tokens_per_step: int) -> dict:
    """Step time, tokens/s and imbalance of one layout's timed steps."""
    wall, compute, plan = (_arr(steps, k) for k in ("wall_s", "compute_s", "plan_s"))
    step_wall = wall.max(axis=1)  # a step ends when its slowest rank does
    imbalance = compute.max(axis=1) / compute.mean(axis=1)
    return {
        "steps": len(steps),
        "step_wall_s_median": float(np.median(step_wall)),
        "tokens_per_s": tokens_per_step / float(np.median(step_wall)),
        # What one accelerator per rank would see: each step takes its busiest rank's compute.
        "compute_bound_tokens_per_s": tokens_per_step * len(steps) / float(compute.max(1).sum()),
        "imbalance_per_step": imbalance.tolist(),
        "mean_imbalance": float(imbalance.mean()),
        "max_imbalance": float(imbalance.max()),
        "plan_ms_median": 1e3 * float(np.median(plan.max(axis=1))),
        # Ranks per gather block in each step (cp unless a dynamic plan widened it).
        "span_per_step": [int(s[0].get("span", 0)) for s in steps],
        "tokens_per_rank": [[r["tokens"] for r in s] for s in steps],
        "wall_s": wall.tolist(),
        "compute_s": compute.tolist(),
        "plan_s": plan.tolist(),
        "terms": [[r["terms"] for r in s] for s in steps],
        # [start, end) of each piece a rank held: what a position profile is fitted on
        **(
            {"pieces": [[r["pieces"] for r in s] for s in steps]}
            if all("pieces" in r for s in steps for r in s)
            else {}
        ),  # fmt: skip
    }


def add_modelled(runs: list[dict], cost: CostModel) -> None:
    """Each layout's mean max/mean rank cost as `cost` models its pieces (vs the measured),
    and dynamic's modelled compute-bound ratios on the same steps (`modelled_ratios`): what
    these steps allow, to tell a draw of easy steps from a shortfall of the plan."""
    coef = np.array([cost.linear, cost.sparse, cost.dense])
    for run in runs:
        busiest = {}
        for name, lay in run["layouts"].items():
            if "pieces" in lay:
                m = np.array([[sum(cost.piece_cost(a, e) for a, e in rank) for rank in step]
                              for step in lay["pieces"]])  # fmt: skip
            elif cost.profile:
                raise ValueError("a cost model with a position profile needs the pieces of "
                                 "each rank (runs recorded before profiles lack them)")  # fmt: skip
            else:
                m = np.array(lay["terms"], dtype=np.float64) @ coef
            lay["modelled_mean_imbalance"] = float((m.max(1) / m.mean(1)).mean())
            busiest[name] = float(m.max(1).sum())
        run["modelled_ratios"] = (
            {
                f"vs_{x}": busiest[x] / busiest["dynamic"]
                for x in ("contiguous", "head_tail")
                if x in busiest
            }  # fmt: skip
            if busiest.get("dynamic")
            else {}
        )


def ratios(layouts: dict[str, dict], key: str) -> dict[str, float]:
    """dynamic over contiguous and over head_tail on `key` (where all are present)."""
    if "dynamic" not in layouts:
        return {}
    d = layouts["dynamic"][key]
    return {f"vs_{x}": d / layouts[x][key] for x in ("contiguous", "head_tail") if x in layouts}


PROFILE_BIN = 512  # positions per bin of a fitted cost profile


def fit_cost(records: list[dict], topk: int) -> tuple[CostModel, dict]:
    """The cost model of measured (rank, step) records -> their compute time: the three-term
    fit (CostModel.fit on each record's terms) and, where the records hold their pieces, the
    position profile (CostModel.fit_profile); the one with the lower mean relative error wins
    (both errors are reported)."""
    y = np.array([r["compute_s"] for r in records], dtype=np.float64)

    def errors(model: CostModel, pieces: list[list[list[int]]]) -> np.ndarray:
        pred = np.array([sum(model.piece_cost(a, e) for a, e in p) for p in pieces])
        return np.abs(pred - y) / y

    terms = CostModel.fit([r["terms"] + [r["compute_s"]] for r in records], topk=topk)
    data = np.array([r["terms"] for r in records], dtype=np.float64)
    rel = np.abs(data @ np.array([terms.linear, terms.sparse, terms.dense]) - y) / y
    best, fit = terms, {"form": "terms", "mean_rel_error_terms": float(rel.mean())}
    if all("pieces" in r for r in records) and len(records) >= 4:
        pieces = [r["pieces"] for r in records]
        try:
            profile = CostModel.fit_profile(zip(pieces, y.tolist()), PROFILE_BIN, topk=topk)
            held_out = _held_out_errors(records, pieces, y, topk)
        except ValueError as e:  # too few or too noisy samples for a profile: the terms stand
            fit["profile_not_fitted"] = str(e)
        else:
            rel_p = errors(profile, pieces)
            fit["mean_rel_error_profile"] = float(rel_p.mean())
            fit["held_out_error"] = held_out
            # The profile has a parameter per bin: chosen on the half of the records each form
            # was not fitted on, not on how well it fits what it was fitted to.
            if held_out["profile"] < held_out["terms"]:
                best, rel, fit["form"] = profile, rel_p, "profile"
    fit.update(samples=len(records), mean_rel_error=float(rel.mean()),
               max_rel_error=float(rel.max()))  # fmt: skip
    return best, fit


def _held_out_errors(records: list[dict], pieces: list, y: np.ndarray, topk: int) -> dict:
    """Mean relative error of each form fitted on every other record, on the rest (both
    ways round)."""
    out = {"terms": [], "profile": []}
    for part in (0, 1):
        fit_on = [i for i in range(len(records)) if i % 2 == part]
        test = [i for i in range(len(records)) if i % 2 != part]
        terms = CostModel.fit([records[i]["terms"] + [y[i]] for i in fit_on], topk=topk)
        prof = CostModel.fit_profile([(pieces[i], y[i]) for i in fit_on], PROFILE_BIN, topk=topk)
        for name, m in (("terms", terms), ("profile", prof)):
            pred = np.array([sum(m.piece_cost(a, e) for a, e in pieces[i]) for i in test])
            out[name] += (np.abs(pred - y[test]) / y[test]).tolist()
    return {k: float(np.mean(v)) for k, v in out.items()}


def describe(model: CostModel) -> str:
    """The fitted model in one line."""
    if model.profile:
        ms = ", ".join(f"{v * 1e3:.3g}" for v in model.profile)
        return (f"per-token cost by position (ms per {model.profile_bin} positions, "
                f"non-decreasing): {ms}")  # fmt: skip
    return (f"linear {model.linear:.3g} s/token, sparse {model.sparse:.3g} s/pair, dense "
            f"{model.dense:.3g} s/pair (topk {model.topk})")  # fmt: skip


def targets(runs: list[dict]) -> list[dict]:
    """Each seq len: dynamic's measured compute-bound ratios and imbalance vs the targets."""
    out = []
    for run in runs:
        r = run["ratios"]["compute_bound_tokens_per_s"]
        dyn = run["layouts"].get("dynamic")
        if not r or dyn is None:
            continue
        row = {"seq_len": run["seq_len"], **r, "imbalance": dyn["mean_imbalance"],
               "modelled": run.get("modelled_ratios", {})}  # fmt: skip
        row["met"] = {k: (row[k] <= v if k == "imbalance" else row[k] >= v)
                      for k, v in TARGETS.items() if k in row}  # fmt: skip
        out.append(row)
    return out


def markdown_measured(runs: list[dict]) -> str:
    head = ["seq len", "layout", "step s", "tokens/s", "compute-bound tok/s", "mean imb.",
            "max imb.", "modelled imb.", "plan ms", "vs contiguous", "vs head_tail"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for run in runs:
        for name, s in run["layouts"].items():
            r = run["ratios"]["compute_bound_tokens_per_s"] if name == "dynamic" else {}
            cells = [str(run["seq_len"]), name, f"{s['step_wall_s_median']:.2f}",
                     f"{s['tokens_per_s']:,.0f}", f"{s['compute_bound_tokens_per_s']:,.0f}",
                     f"{s['mean_imbalance']:.3f}", f"{s['max_imbalance']:.3f}",
                     f"{s['modelled_mean_imbalance']:.3f}", f"{s['plan_ms_median']:.1f}",
                     *(f"{r[k]:.2f}x" if k in r else "" for k in ("vs_contiguous", "vs_head_tail"))]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_line(rows: list[dict]) -> str:
    """One line per seq len: dynamic's compute-bound ratios and imbalance against the targets."""
    out = []
    for t in rows:
        parts = [f"{k.replace('_', ' ')} {t[k]:.3f} ({'<=' if k == 'imbalance' else '>='} "
                 f"{v}: {'met' if t['met'][k] else 'MISSED'})" for k, v in TARGETS.items()]  # fmt: skip
        line = f"targets at {t['seq_len']} tokens (dynamic, compute-bound): " + ", ".join(parts)
        if t.get("modelled"):
            line += "; the cost model gives these steps " + ", ".join(
                f"{k.replace('_', ' ')} {v:.3f}" for k, v in t["modelled"].items()
            )
        out.append(line)
    return "\n".join(out)


def markdown_simulated(rows: list[dict]) -> str:
    head = ["ranks", "cp", "seq len", "layout", "mean imb.", "bound imb.", "efficiency",
            "rel. throughput", "gathering blocks", "mean span"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["ranks"]), str(r["cp"]), str(r["seq_len"]), r["layout"],
                 f"{r['mean_imbalance']:.3f}", f"{r['bound_imbalance']:.3f}",
                 f"{r['efficiency']:.3f}", f"{r['rel_throughput']:.2f}x",
                 f"{r['gather_fraction']:.0%}", f"{r['mean_span']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _figure(rows: int, cols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, no pyplot: no global state, no display needed
    return fig, fig.subplots(rows, cols, squeeze=False)


def plot_measured(runs: list[dict], path: Path) -> None:
    """Per-rank compute (CPU) time per step: a row of panels per seq len, one per layout."""
    cols = max(len(run["layouts"]) for run in runs)
    fig, axes = _figure(len(runs), cols)
    for i, run in enumerate(runs):
        top = max(max(map(max, s["compute_s"])) for s in run["layouts"].values())
        for j, (name, s) in enumerate(run["layouts"].items()):
            ax, t = axes[i][j], np.array(s["compute_s"])
            width = 0.8 / t.shape[1]
            for r in range(t.shape[1]):
                ax.bar(np.arange(1, len(t) + 1) + (r - (t.shape[1] - 1) / 2) * width, t[:, r],
                       width, label=f"rank {r}")  # fmt: skip
            ax.set_ylim(0, 1.1 * top)
            ax.set_title(f"{name}, {run['seq_len']} tok: imb. {s['mean_imbalance']:.2f}",
                         fontsize=9)  # fmt: skip
            ax.set_xticks(range(1, len(t) + 1))
            ax.set_xlabel("timed step")
            ax.set_ylabel("fwd+bwd CPU s")
        for j in range(len(run["layouts"]), cols):
            axes[i][j].set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, dpi=100)


def plot_simulated(rows: list[dict], path: Path) -> None:
    """Modelled mean imbalance vs rank count, one panel per seq len, a line per layout."""
    seq_lens = sorted({r["seq_len"] for r in rows})
    fig, axes = _figure(1, len(seq_lens))
    for ax, seq in zip(axes[0], seq_lens):
        for layout in LAYOUTS:
            pts = sorted((r["ranks"], r["mean_imbalance"]) for r in rows
                         if r["seq_len"] == seq and r["layout"] == layout)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), marker="o", label=layout)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{seq} tokens per CP group", fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("modelled max/mean rank cost")
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, dpi=100)
