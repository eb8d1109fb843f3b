"""`wanka bench comm` results: per-case summaries, ratios vs the baseline, Markdown tables.

Pure functions of the run records bench/comm.py collects: {"steps", "repeat", "sent": {node:
bytes}, "step_time_s": [...], "tokens_per_s": [...], "window_bytes_per_step", ...}.
"""

from __future__ import annotations

import statistics

from wanka.bench.comm_cases import BASELINE

METHOD = {
    "bytes_per_step": "kernel interface counters: bytes each node sent over its inter-node "
    "link (rx_bytes of the bridge side of its veth, Ethernet frames incl. headers and ACKs), "
    "summed over nodes; each case runs for N1 and N2 steps and bytes/step = (B(N2) - B(N1)) / "
    "(N2 - N1), so start-up, final evaluation and teardown cancel. Median over repeats.",
    "window_bytes_per_step": "cross-check: counters sampled at 20 Hz during the N2 run, "
    "interpolated at the times rank 0 logged the first step after warm-up and the last step.",
    "step_time_s": "median of rank 0's step_time (metrics.jsonl) over both runs' steps after "
    "the warm-up steps",
    "tokens_per_s": "median of metrics.jsonl tokens_per_s over the same steps",
    "link_s_per_step": "the busiest node's sent bytes per step / link rate: the least time "
    "the link needs per step",
}


def _spread(xs: list[float]) -> float | None:
    """(max - min) / median: run-to-run variation of repeated measurements."""
    if len(xs) < 2 or not statistics.median(xs):
        return None
    return (max(xs) - min(xs)) / statistics.median(xs)


def summarise_case(runs: list[dict], n1: int, n2: int, gbit: float,
                   error: str | None = None) -> dict:  # fmt: skip
    """One case at one link rate: per-step bytes from each repeat's (N1, N2) pair, medians of
    step time and tokens/s over all its runs' steps after the warm-up."""
    pairs = []
    for rep in sorted({r["repeat"] for r in runs}):
        by = {r["steps"]: r for r in runs if r["repeat"] == rep}
        if n1 in by and n2 in by:
            pairs.append((by[n1], by[n2]))
    per_rep = [(sum(b["sent"].values()) - sum(a["sent"].values())) / (n2 - n1) for a, b in pairs]
    nodes = sorted(pairs[0][0]["sent"]) if pairs else []
    per_node = {n: statistics.median([(b["sent"][n] - a["sent"][n]) / (n2 - n1) for a, b in pairs])
                for n in nodes}  # fmt: skip
    steps = [t for r in runs for t in r["step_time_s"]]
    tps = [t for r in runs for t in r["tokens_per_s"]]
    windows = [b["window_bytes_per_step"] for _, b in pairs if b["window_bytes_per_step"]]
    out = {
        "error": error if error or pairs else "no complete (N1, N2) pair of runs",
        "bytes_per_step": statistics.median(per_rep) if per_rep else None,
        "bytes_per_step_repeats": per_rep, "bytes_spread": _spread(per_rep),
        "sent_per_step_by_node": per_node,
        "window_bytes_per_step": statistics.median(windows) if windows else None,
        "step_time_s": statistics.median(steps) if steps else None,
        "step_time_spread": _spread([statistics.median(r["step_time_s"]) for r in runs
                                     if r["step_time_s"]]),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "link_s_per_step": max(per_node.values()) / (gbit * 1e9 / 8) if per_node else None,
        "runs": runs,
    }  # fmt: skip
    return out


def add_ratios(cases: dict[str, dict]) -> None:
    """Each case's bytes/step, step time and tokens/s over the baseline's (None if missing)."""
    base = cases.get(BASELINE, {})
    for s in cases.values():
        s["ratios"] = {k: (s[k] / base[k] if s.get(k) is not None and base.get(k) else None)
                       for k in ("bytes_per_step", "step_time_s", "tokens_per_s")}  # fmt: skip


def best(links: list[dict]) -> dict[str, str | None]:
    """Per link rate: the case with the shortest step time ("the best combination" measured)."""
    out = {}
    for link in links:
        ok = {n: s["step_time_s"] for n, s in link["cases"].items() if s.get("step_time_s")}
        out[f"{link['gbit']:g}"] = min(ok, key=ok.get) if ok else None
    return out


def add_convergence_diffs(cases: dict[str, dict]) -> None:
    """rel_diff = (val_loss - baseline's) / baseline's; met = |rel_diff| <= tolerance; verdict
    also tells the two ways out of it apart: "lower" (a lower loss than the baseline's, past the
    tolerance: outside the band, but not a loss of convergence) and "MISSED" (higher)."""
    base = cases.get(BASELINE, {}).get("val_loss")
    for c in cases.values():
        v = c.get("val_loss")
        d = c["rel_diff"] = (v - base) / base if v is not None and base else None
        c["met"] = None if d is None else abs(d) <= c["tolerance"]
        c["verdict"] = (None if d is None else "met" if c["met"] else
                        "lower" if d < 0 else "MISSED")  # fmt: skip


def failures(doc: dict) -> list[tuple[str, str]]:
    """(case, why) for every case that failed somewhere, once each."""
    seen: dict[str, str] = {}
    for link in doc.get("links", []):
        for name, s in link["cases"].items():
            if s.get("error"):
                seen.setdefault(name, f"{link['gbit']:g} Gbit/s: {s['error']}")
    for name, c in doc.get("convergence", {}).get("cases", {}).items():
        if c.get("error"):
            seen.setdefault(name, f"convergence: {c['error']}")
    return list(seen.items())


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _inverse(ratio: float | None) -> float | None:
    """case / flat -> flat / case: how many times fewer bytes, how many times faster."""
    return 1 / ratio if ratio else None


def _f(v: float | None, fmt: str) -> str:
    return format(v, fmt) if v is not None else "-"


def markdown(doc: dict) -> str:
    """One row per case: bytes/step and its ratio (from the first link rate), then per link
    rate step time, its ratio and tokens/s, then the convergence check, side by side."""
    names = [c["name"] for c in doc["cases"]]
    links = doc.get("links", [])
    conv = doc.get("convergence", {}).get("cases", {})
    head = ["case"]
    if links:
        head += ["inter-node MB/step", "fewer bytes than flat"]
        for link in links:
            g = f"{link['gbit']:g}G"
            head += [f"step s @{g}", f"speed-up vs flat @{g}", f"tok/s @{g}"]
    if conv:
        head += ["val loss", "vs flat", "target"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for n in names:
        cells = [n]
        if links:
            s0 = links[0]["cases"][n]
            b = s0["bytes_per_step"]
            cells += [
                _f(b / 1e6 if b is not None else None, ".2f"),
                _x(_inverse(s0["ratios"]["bytes_per_step"])),
            ]
            for link in links:
                s = link["cases"][n]
                cells += [_f(s["step_time_s"], ".3f"), _x(_inverse(s["ratios"]["step_time_s"])),
                          _f(s["tokens_per_s"], ",.0f")]  # fmt: skip
        if conv:
            c = conv.get(n, {})
            met = {"met": "met", "lower": "outside (lower loss)", "MISSED": "MISSED",
                   None: "-"}[c.get("verdict")]  # fmt: skip
            cells += [_f(c.get("val_loss"), ".4f"), _f(c.get("rel_diff"), "+.3%"),
                      f"±{c.get('tolerance', 0):.0%} {met}" if n != BASELINE else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _notes(doc))


def _notes(doc: dict) -> list[str]:
    out = [""]
    setup = doc["setup"]
    if doc.get("links"):
        n1, n2 = setup["steps"]
        out.append(f"{setup['nodes']} nodes x {setup['nproc_per_node']} ranks (gloo, CPU), "
                   f"shape {setup['measure_shape']}; bytes/step = counter difference of "
                   f"{n1}- and {n2}-step runs, median of {setup['repeats']} repeat(s); "
                   f"step time = median after {setup['warmup_steps']} warm-up steps.")  # fmt: skip
        for link in doc["links"]:
            for key, what in (("bytes_spread", "bytes/step"), ("step_time_spread", "step time")):
                spreads = {n: s[key] for n, s in link["cases"].items() if s.get(key) is not None}
                if spreads:
                    worst = max(spreads, key=spreads.get)
                    out.append(f"@{link['gbit']:g} Gbit/s run-to-run {what} spread (max-min)/median: "
                               f"up to {spreads[worst]:.2%} ({worst}).")  # fmt: skip
        out.append("best (shortest step): " + ", ".join(
            f"{g} Gbit/s {n or '-'}" for g, n in doc.get("best", {}).items()) + ".")  # fmt: skip
    if conv := doc.get("convergence"):
        out.append(f"convergence: {conv['steps']} steps on {conv['where']}, shape "
                   f"{conv['shape']}; |val loss - flat's| / flat's within the target "
                   f"({conv['wall_s'] / 60:.1f} min).")  # fmt: skip
    m = doc["machine"]
    load = f", load average {m['loadavg'][0]:.1f} at start" if m.get("loadavg") else ""
    out.append(f"{m.get('cpus')} CPUs ({m.get('cpu_model')}){load}, {doc['date']}: "
               f"`{doc['command']}`")  # fmt: skip
    return out
