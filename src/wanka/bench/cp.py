"""`wanka bench cp`: context-parallel layouts (contiguous, head_tail, dynamic) compared on
step time, tokens/s and per-rank compute imbalance.

Measured (default): dp x cp spawned gloo ranks (4 = 1 x 4) train a small model, forward +
backward only (no optimizer step: it is the same for every layout), on packed rows drawn
with cp_sim.draw_rows from a document-length distribution: the built-in corpus's (bytes =
tokens with the byte tokenizer) or a user's file (`--lengths`, one length per line). Every
layout runs the same rows. Per rank and step: wall time and the rank's own CPU time. Each
(rank, step) also gives the cost-model terms of the pieces it held, and CostModel.fit on
all of them is saved, to drive `--simulate`.

Simulated (`--simulate --ranks 64,256,1024`): no model; cp_sim.simulate with the cost model
of a measured run's JSON (`--cost`), or CostModel's defaults with a loud note.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from wanka.bench import cp_report as report
from wanka.bench.output import write_out
from wanka.distributed.cp_cost import CostModel, load_cost

SEQ_LENS = (8192, 16384, 32768)
QUICK = {"seq_lens": (8192,), "steps": 3}
FULL = {"seq_lens": SEQ_LENS, "steps": 8}
SIM_STEPS = 20
REPLAY_REPEATS = 3  # --replay: runs of each rank's share per step; the fastest counts
CALIB_STEPS = 2  # contiguous + head_tail steps that fit dynamic's cost model, not reported
# Small enough that a step of 8k tokens takes seconds per rank on CPU; every block kind
# (dense + MoE layer, an indexer on each, MTP) so the CP path is the trainer's.
MODEL = {"dim": 128, "n_layers": 2, "n_heads": 4, "head_dim": 32, "n_index_heads": 2,
         "index_head_dim": 16, "index_topk": 256, "n_experts": 8, "n_active_experts": 2,
         "expert_hidden": 128, "mtp_depth": 1}  # fmt: skip


def notes(nproc: int, cpus: int, cost_given: bool, repeats: int = 0) -> list[str]:
    planned = (
        "dynamic plans with the --cost model; every layout runs each timed step, in turn."
        if cost_given
        else f"dynamic plans with the cost model fitted on {CALIB_STEPS} calibration steps of "
        "contiguous and head_tail (not reported); every layout runs each timed step, in turn."
    )
    if repeats:
        return [
            f"replayed: each of the {nproc} ranks' forward+backward ran alone in one process on "
            f"one thread, {repeats} times (compute = the fastest), with the plan the ranks make "
            "and its gathers answered by the real keys (captured from all ranks' forwards in "
            "lockstep, untimed); no communication, no FSDP: compute-bound tokens/s = tokens / "
            "the busiest rank's compute, what one accelerator per rank would see.",
            "step s and tokens/s are the same compute-bound view (median busiest rank).",
            "imbalance = max / mean rank compute per step; modelled = the same from the fitted "
            "cost model on each rank's pieces.",
            planned,
            "step = plan + shard + forward + backward (sparse phase); no optimizer step.",
        ]
    return [
        f"compute = each rank's own CPU time (time.thread_time) of forward+backward: {nproc} "
        f"ranks ran on {cpus} cores, so wall time hides imbalance when ranks outnumber cores, "
        "while CPU time is each rank's own work. compute-bound tokens/s = tokens / the busiest "
        "rank's compute, summed over steps: what one accelerator per rank would see.",
        "tokens/s = tokens per step / median step wall time (slowest rank), on this machine.",
        "imbalance = max / mean rank compute per step; modelled = the same from the fitted cost "
        "model on each rank's pieces.",
        planned,
        "step = plan + shard + forward + backward (sparse phase); no optimizer step.",
    ]


MAX_DOC_TOKENS = 2**40  # far past any corpus; keeps the lengths in int64 arithmetic


def read_lengths(path: Path) -> np.ndarray:
    """One positive integer per line; blank lines and # comments are skipped. A bad line is
    a ValueError naming the file and line (the CLI prints it as one line, exit 2)."""
    if not path.is_file():
        raise FileNotFoundError(f"--lengths {path}: no such file")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"--lengths {path} line {n}: {text[:40]!r} is not an integer "
                                 "(one document length in tokens per line)") from None  # fmt: skip
            if value <= 0:
                raise ValueError(f"--lengths {path} line {n}: length {value} must be positive")
            if value > MAX_DOC_TOKENS:
                raise ValueError(f"--lengths {path} line {n}: length {value} is too large "
                                 f"(at most {MAX_DOC_TOKENS} tokens per document)")  # fmt: skip
            out.append(value)
    if not out:
        raise ValueError(f"--lengths {path}: no document lengths in the file")
    return np.array(out, dtype=np.int64)


def builtin_lengths() -> np.ndarray:
    from wanka.data.corpus import builtin_documents

    return np.array([len(d.text.encode()) for d in builtin_documents()], dtype=np.int64)


def length_summary(lengths: np.ndarray, source: str) -> dict:
    return {"source": source, "count": int(len(lengths)), "tokens": int(lengths.sum()),
            "mean": float(lengths.mean()), "median": float(np.median(lengths)),
            "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max())}  # fmt: skip


def read_cost(path: Path) -> CostModel:
    """The fitted cost model of a measured run's JSON (or a JSON of just its fields)."""
    try:
        return load_cost(path, "--cost")
    except OSError as e:  # (a folder: a traceback, while training said it in one line)
        raise ValueError(str(e)) from None


def _check_seq_lens(seq_lens: tuple[int, ...], cp: int) -> None:
    for s in seq_lens:
        if s < cp or s % cp:
            raise ValueError(f"--seq-len {s} must be a positive multiple of cp={cp} "
                             "(the contiguous layout cuts each row into cp equal chunks)")  # fmt: skip


def _write(doc: dict, table: str, out: Path, plot) -> None:
    write_out(out, json.dumps(doc, indent=1))
    md = out.with_suffix(".md") if out.suffix != ".md" else out.with_suffix(".table.md")
    write_out(md, table + "\n\n" + "\n".join(f"- {n}" for n in doc["notes"]) + "\n")
    png = out.with_suffix(".png")
    plot(png)
    print(table)
    for n in doc["notes"]:
        print(f"note: {n}")
    print(f"wrote {out}, {md} and {png}")


def _machine() -> dict:
    from wanka.bench.train import machine_info

    return {**machine_info(), "torch": torch.__version__}


def run_measured(lengths: np.ndarray, source: str, out: Path, *, seq_lens: tuple[int, ...],
                 steps: int, dp: int, cp: int, nproc: int, seed: int,
                 cost: CostModel | None, replay: int = 0, index_topk: int | None = None,
                 ) -> dict:  # fmt: skip
    """replay > 0: no spawned ranks; each rank replayed alone that many times (cp_replay.py)."""
    from wanka.bench.cp_worker import spawn_ranks
    from wanka.distributed.cp_sim import draw_rows

    if nproc != dp * cp:
        raise ValueError(f"--nproc {nproc} must equal --dp {dp} x --cp {cp}")
    _check_seq_lens(seq_lens, cp)
    model = {**MODEL, "max_seq_len": max(seq_lens)}  # RoPE tables cover the longest document
    if index_topk is not None:
        model["index_topk"] = index_topk
    if cost is not None and cost.topk != model["index_topk"]:
        raise ValueError(f"--cost has topk {cost.topk}; this model's index_topk (--index-topk) is "
                         f"{model['index_topk']}")  # fmt: skip
    calib = 0 if cost else CALIB_STEPS
    rows = []  # per seq len: warm-up, calibration, timed steps; each dp rows of fragments
    for s in seq_lens:
        rng = np.random.default_rng([seed, s])
        rows.append([draw_rows(rng, lengths, dp, s) for _ in range(1 + calib + steps)])
    spec = {"model": model, "dp": dp, "cp": cp, "seed": seed, "layouts": list(report.LAYOUTS),
            "cost": dataclasses.asdict(cost) if cost else None, "seq_lens": list(seq_lens),
            "calib": calib, "rows": rows}  # fmt: skip
    how = f"replayed one at a time x {replay}" if replay else "spawned"
    print(f"wanka bench cp: {nproc} ranks (dp {dp} x cp {cp}, {how}), seq lens "
          f"{list(seq_lens)}, 1 warm-up, {calib} calibration and {steps} timed steps, "
          f"lengths: {source}", flush=True)  # fmt: skip
    if replay:
        from wanka.bench.cp_replay import run_replay

        raw = run_replay(spec, replay)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            raw = spawn_ranks(nproc, Path(tmp) / "raw.json", spec)
    runs, records = [], []
    for s, r, steps_rows in zip(seq_lens, raw, rows):
        layouts = {x: report.summarise_layout(st, dp * s) for x, st in r["per_step"].items()}
        runs.append({"seq_len": s, "tokens_per_step": dp * s, "plan_cost": r["plan_cost"],
                     "fragments_per_step": [[len(x) for x in st] for st in steps_rows[1 + calib :]],
                     "layouts": layouts})  # fmt: skip
        records += [rec for part in ("calibration", "per_step") for st in r[part].values()
                    for step in st for rec in step]  # fmt: skip
    fitted, fit = report.fit_cost(records, model["index_topk"])
    machine = _machine()
    report.add_modelled(runs, fitted)
    for run in runs:
        run["ratios"] = {k: report.ratios(run["layouts"], k)
                         for k in ("tokens_per_s", "compute_bound_tokens_per_s")}  # fmt: skip
    doc = {
        "mode": "replay" if replay else "measured", "machine": machine,
        "notes": notes(nproc, machine["cpus"], cost is not None, replay),
        "setup": {"nproc": nproc, "dp": dp, "cp": cp, "steps": steps, "warmup_steps": 1,
                  "calibration_steps": calib,
                  "seed": seed, "seq_lens": list(seq_lens), "torch_threads_per_rank": 1,
                  "phase": "sparse", "model": model, "cost_given": cost is not None,
                  "replay_repeats": replay},
        "lengths": length_summary(lengths, source), "runs": runs,
        "cost_model": dataclasses.asdict(fitted), "fit": fit, "targets": report.targets(runs),
    }  # fmt: skip
    table = report.markdown_measured(runs)
    table += (f"\n\ncost model fit on {fit['samples']} (rank, step) samples: "
              f"{report.describe(fitted)}; mean relative error {fit['mean_rel_error']:.1%}, "
              f"max {fit['max_rel_error']:.1%}")  # fmt: skip
    table += "\n" + report.targets_line(doc["targets"])
    _write(doc, table, out, lambda p: report.plot_measured(runs, p))
    return doc


def run_simulated(lengths: np.ndarray, source: str, out: Path, *, ranks: tuple[int, ...],
                  cp: int, seq_lens: tuple[int, ...], steps: int, seed: int,
                  cost: CostModel | None, cost_source: str) -> dict:  # fmt: skip
    from wanka.distributed.cp_sim import simulate

    _check_seq_lens(seq_lens, cp)
    for n in ranks:
        if n < cp or n % cp:
            raise ValueError(f"--ranks {n} must be a positive multiple of --cp {cp}")
    notes = ["modelled, not measured: each step's time is its busiest rank's modelled cost; "
             "rel. throughput = tokens per modelled second over contiguous's at the same "
             "ranks and seq len; bound imb. = the best a layout that keeps each document "
             "inside one CP group could do (mean, or the largest document spread over cp "
             "ranks): dynamic goes below it by widening the gather block (mean span > cp)."]  # fmt: skip
    if cost is None:
        cost = CostModel()
        notes.insert(0, "NO FITTED COST MODEL (--cost): using CostModel() defaults, a FLOP "
                        "estimate of the production shape, not a measurement of this code")  # fmt: skip
        cost_source = "CostModel() defaults"
    rows, ratios = [], []
    for n in ranks:
        for s in seq_lens:
            got = {x: simulate(lengths, s, n, cp, x, cost, steps, seed) for x in report.LAYOUTS}
            base = got["contiguous"]["throughput"]
            for x, r in got.items():
                keep = ("ranks", "cp", "dp", "seq_len", "steps", "mean_imbalance", "throughput",
                        "efficiency", "bound_imbalance", "gather_fraction",
                        "lmax_over_mean_tokens", "mean_span")  # fmt: skip
                rows.append({"layout": x, **{k: r[k] for k in keep},
                             "max_imbalance": max(r["imbalance"]),
                             "rel_throughput": r["throughput"] / base})  # fmt: skip
            dyn = got["dynamic"]["throughput"]
            ratios.append({"ranks": n, "seq_len": s, "vs_contiguous": dyn / base,
                           "vs_head_tail": dyn / got["head_tail"]["throughput"]})  # fmt: skip
            print(f"ranks {n}, seq len {s}: dynamic {ratios[-1]['vs_contiguous']:.2f}x "
                  f"contiguous, {ratios[-1]['vs_head_tail']:.2f}x head_tail", flush=True)  # fmt: skip
    doc = {"mode": "simulate", "machine": _machine(), "notes": notes,
           "setup": {"ranks": list(ranks), "cp": cp, "seq_lens": list(seq_lens), "steps": steps,
                     "seed": seed},
           "lengths": length_summary(lengths, source),
           "cost_model": {**dataclasses.asdict(cost), "source": cost_source}, "rows": rows,
           "dynamic_ratios": ratios}  # fmt: skip
    _write(doc, report.markdown_simulated(rows), out, lambda p: report.plot_simulated(rows, p))
    return doc


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} wants a comma list of integers, got {text!r}") from None


def _given(value: int | None, default: int, flag: str) -> int:
    value = default if value is None else value
    if value < 1:
        raise ValueError(f"{flag} must be 1 or more, got {value}")
    return value


def bench_cp_main(args) -> int:
    """The CLI entry (argparse namespace of `wanka bench cp`)."""
    cost = read_cost(Path(args.cost)) if args.cost else None  # cheap checks first
    topk = args.index_topk
    if topk is not None and not 1 <= topk <= 1 << 20:
        raise ValueError(f"--index-topk must be in 1..{1 << 20}, got {topk}")
    lengths_path = Path(args.lengths) if args.lengths else None
    lengths = read_lengths(lengths_path) if lengths_path else builtin_lengths()
    source = str(lengths_path) if lengths_path else "builtin corpus (bytes per document)"
    preset = QUICK if args.quick else FULL
    seq_lens = _ints(args.seq_len, "--seq-len") or preset["seq_lens"]
    if args.repeats is not None and not args.replay:
        raise ValueError("--repeats counts the runs of each rank under --replay: add --replay")
    if args.simulate and args.replay:
        raise ValueError("--simulate models and --replay measures: pick one of them")
    if args.simulate:
        ranks = _ints(args.ranks, "--ranks") or (64, 256, 1024)
        out = Path(args.out or "runs/bench/cp_simulate.json")
        if topk is not None:
            cost = dataclasses.replace(cost or CostModel(), topk=topk)
        run_simulated(lengths, source, out, ranks=ranks, cp=_given(args.cp, 8, "--cp"),
                      seq_lens=seq_lens, steps=_given(args.steps, SIM_STEPS, "--steps"),
                      seed=args.seed, cost=cost, cost_source=str(args.cost))  # fmt: skip
        return 0
    cp = _given(args.cp, 4, "--cp")
    dp = _given(args.dp, max(1, (args.nproc or cp) // cp), "--dp")
    nproc = _given(args.nproc, dp * cp, "--nproc")
    repeats = _given(args.repeats, REPLAY_REPEATS, "--repeats") if args.replay else 0
    run_measured(lengths, source, Path(args.out or "runs/bench/cp.json"), seq_lens=seq_lens,
                 steps=_given(args.steps, preset["steps"], "--steps"), dp=dp, cp=cp,
                 nproc=nproc, seed=args.seed, cost=cost, replay=repeats,
                 index_topk=topk)  # fmt: skip
    return 0
