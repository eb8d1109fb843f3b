"""`wanka bench ops` JSON -> a Markdown table: one row per (op, shape, index pattern), the
reference and the fast backend side by side, and, when the cases ran at several torch thread
counts, each thread count side by side too.

    python -m wanka.bench.ops_table runs/bench/ops.json > runs/bench/ops.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = (
    "| op | L | k | indices | reference fwd / fwd+bwd (s) | {fast} fwd / fwd+bwd (s) | speed-up "
    "fwd+bwd | reference peak MB | {fast} peak MB | memory ratio | {fast} max abs err | {fast} "
    "% of matmul peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _shape_key(r: dict) -> tuple:
    return (r["L"], r["op"], r.get("k") or 0, r.get("pattern") or "")


def _times(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return r["skipped"]
    if "error" in r:
        return f"failed: {r['error']}"
    return f"{r['fwd_s']:.3f} / {r['fwd_bwd_s']:.3f}"


def _measured(r: dict | None) -> bool:
    return r is not None and "fwd_bwd_s" in r


PATTERN_LABELS = {
    "block": "block (window + 64-key blocks)",
    "packed": "packed (realistic, 8 docs)",
}


def _indices(r: dict) -> str:
    if r["op"] == "sparse_attention":
        return PATTERN_LABELS.get(r["pattern"], r["pattern"])
    if r["op"] == "lightning_indexer":
        return f"{r['Hi']} heads x {r['Di']}"
    return "causal, 1 doc"


def markdown_table(doc: dict, fast: str = "cpu") -> str:
    """Rows of `doc["cases"]` paired by shape: reference vs the `fast` backend (per thread
    count, side by side, when the rows ran at more than one)."""
    threads = sorted({int(r["threads"]) for r in doc["cases"] if r.get("threads")})
    if len(threads) > 1:
        return _threads_table(doc, fast, threads)
    pairs: dict[tuple, dict] = {}
    for r in doc["cases"]:
        pairs.setdefault(_shape_key(r), {})[r["backend"]] = r
    lines = [HEADER.format(fast=fast)]
    for key in sorted(pairs):
        ref, mine = pairs[key].get("reference"), pairs[key].get(fast)
        any_row = mine or ref
        if any_row is None:  # only other backends at this shape
            continue
        both = _measured(ref) and _measured(mine)
        speed = f"{ref['fwd_bwd_s'] / mine['fwd_bwd_s']:.2f}x" if both else ""
        mem = f"{ref['peak_mb'] / max(mine['peak_mb'], 1.0):.0f}x" if both else ""
        ref_peak = f"{ref['peak_mb']:.0f}" if _measured(ref) else ""
        my_peak = f"{mine['peak_mb']:.0f}" if _measured(mine) else ""
        err = f"{mine['max_abs_err']:.1e}" if _measured(mine) and "max_abs_err" in mine else ""
        if _measured(mine) and not err:
            err = "(reference not rerun)"
        frac = (
            f"{mine['fraction_of_peak']:.0%}"
            if _measured(mine) and "fraction_of_peak" in mine
            else ""
        )
        k = any_row.get("k") or "-"
        lines.append(
            f"| {any_row['op']} | {any_row['L']} | {k} | {_indices(any_row)} | {_times(ref)} | "
            f"{_times(mine)} | {speed} | {ref_peak} | {my_peak} | {mem} | {err} | {frac} |"
        )
    return "\n".join(lines)


def _threads_table(doc: dict, fast: str, threads: list[int]) -> str:
    """One row per shape; for each thread count the reference's and `fast`'s times and the
    speed-up; then `fast`'s gain from the most threads over 1, and memory, error and share of
    the matmul peak from the most threads' run."""
    cells: dict[tuple, dict] = {}
    for r in doc["cases"]:
        if r.get("threads"):
            cells.setdefault(_shape_key(r), {})[(r["backend"], int(r["threads"]))] = r
    top = threads[-1]
    head = ["op", "L", "k", "indices"]
    for t in threads:
        th = f"{t} thread{'s' if t > 1 else ''}"
        head += [f"reference fwd / fwd+bwd (s), {th}", f"{fast} fwd / fwd+bwd (s), {th}",
                 f"speed-up fwd+bwd, {th}"]  # fmt: skip
    head += [f"{fast} {top} threads vs 1", f"reference peak MB ({top})", f"{fast} peak MB",
             "memory ratio", f"{fast} max abs err", f"{fast} % of matmul peak ({top})"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(cells):
        c = cells[key]
        mine_rows = [c.get((fast, t)) for t in threads]
        if not any(mine_rows) and not any(c.get(("reference", t)) for t in threads):
            continue  # only other backends at this shape
        any_row = next(r for r in c.values())
        k = any_row.get("k") or "-"
        row = [any_row["op"], str(any_row["L"]), str(k), _indices(any_row)]
        for t in threads:
            ref, mine = c.get(("reference", t)), c.get((fast, t))
            both = _measured(ref) and _measured(mine)
            row += [_times(ref), _times(mine),
                    f"{ref['fwd_bwd_s'] / mine['fwd_bwd_s']:.2f}x" if both else ""]  # fmt: skip
        one, many = c.get((fast, threads[0])), c.get((fast, top))
        row.append(
            f"{one['fwd_bwd_s'] / many['fwd_bwd_s']:.2f}x"
            if _measured(one) and _measured(many)
            else ""
        )
        ref, mine = c.get(("reference", top)), many
        both = _measured(ref) and _measured(mine)
        row.append(f"{ref['peak_mb']:.0f}" if _measured(ref) else "")
        row.append(f"{mine['peak_mb']:.0f}" if _measured(mine) else "")
        row.append(f"{ref['peak_mb'] / max(mine['peak_mb'], 1.0):.0f}x" if both else "")
        errs = [r["max_abs_err"] for r in mine_rows if _measured(r) and "max_abs_err" in r]
        err = f"{max(errs):.1e}" if errs else ""
        if not err and any(_measured(r) for r in mine_rows):
            err = "(reference not rerun)"
        row.append(err)
        frac = _measured(mine) and "fraction_of_peak" in mine
        row.append(f"{mine['fraction_of_peak']:.0%}" if frac else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m wanka.bench.ops_table OPS.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(
            f"cannot read {path}: {e}; pass the JSON written by `wanka bench ops`", file=sys.stderr
        )
        return 2
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        print(
            f"{path} has no 'cases' list: pass the JSON written by `wanka bench ops`",
            file=sys.stderr,
        )
        return 2
    try:
        table = markdown_table(doc)
    except (KeyError, TypeError, ValueError) as e:
        print(f"{path}: a row lacks {e} or has the wrong type: pass the JSON written by "
              "`wanka bench ops` (the GPU script writes its own table)", file=sys.stderr)  # fmt: skip
        return 2
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
