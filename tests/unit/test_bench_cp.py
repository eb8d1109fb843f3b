"""`wanka bench cp` without spawning ranks: the length file, the rows every rank builds, the
simulate path, and the shape of the measured results (from synthetic rank records)."""

import json

import numpy as np
import pytest

from wanka.bench import cp_report as report
from wanka.bench.cp import read_cost, read_lengths, run_simulated
from wanka.bench.cp_worker import packed_batch
from wanka.cli import main
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_plan import rows_from_doc_ids

PNG = b"\x89PNG\r\n\x1a\n"


def test_lengths_file_skips_blanks_and_comments(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# my corpus\n120\n\n  4096  \n7 # a short one\n")
    assert read_lengths(f).tolist() == [120, 4096, 7]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("10\nabc\n", "line 2: 'abc' is not an integer"),
        ("10\n20\n1.5\n", "line 3: '1.5' is not an integer"),
        ("0\n", "line 1: length 0 must be positive"),
        ("5\n-3\n", "line 2: length -3 must be positive"),
        ("5\n99999999999999999999\n", "line 2: length 99999999999999999999 is too large"),
        ("# only a comment\n\n", "no document lengths"),
    ],
)
def test_bad_lengths_file_is_one_line_exit_2(tmp_path, capsys, text, fragment):
    f = tmp_path / "lengths.txt"
    f.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        read_lengths(f)
    assert main(["bench", "cp", "--lengths", str(f), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and fragment in err[0], err
    assert not (tmp_path / "o.json").exists()


def test_missing_lengths_file_exit_2(tmp_path, capsys):
    assert main(["bench", "cp", "--lengths", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err


def test_packed_batch_matches_the_fragments():
    rows = [[3, 5], [8], [1, 6, 1]]
    b = packed_batch(rows, vocab=256, seed=0)
    assert b.tokens.shape == (3, 8)
    assert rows_from_doc_ids(b.doc_ids.numpy()) == rows
    assert b.positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    # Labels: the next token inside a fragment, ignored at each fragment's end.
    assert b.labels[0, :2].tolist() == b.tokens[0, 1:3].tolist()
    assert b.labels[0, 2] == -100 and b.labels[0, 7] == -100 and b.labels[2, 0] == -100
    assert packed_batch(rows, 256, 0).tokens.equal(b.tokens)  # every rank builds the same


def _records(steps: int, ranks: int, skew: float) -> list[list[dict]]:
    """Synthetic rank records: rank r's compute grows with r by `skew`."""
    out = []
    for s in range(steps):
        out.append([{"rank": r, "tokens": 100, "wall_s": 2.0 + 0.1 * s, "plan_s": 0.001,
                     "compute_s": 1.0 + skew * r, "terms": [100, 50 * (r + 1), 400 * (r + 1)]}
                    for r in range(ranks)])  # fmt: skip
    return out


def test_measured_summary_table_and_plot(tmp_path):
    skews = {"contiguous": 0.3, "head_tail": 0.1, "dynamic": 0.0}
    runs = [{"seq_len": 400, "layouts": {x: report.summarise_layout(_records(2, 4, k), 400)
                                         for x, k in skews.items()}}]  # fmt: skip
    records = [r for k in skews.values() for step in _records(2, 4, k) for r in step]
    fitted, fit = report.fit_cost(records, topk=16)
    # Pieces differ by layout: head_tail's busiest rank holds twice dynamic's.
    runs[0]["layouts"]["head_tail"]["terms"] = [[[100, 400, 3200]] + [[100, 50, 400]] * 3] * 2
    runs[0]["layouts"]["dynamic"]["terms"] = [[[100, 200, 1600]] + [[100, 50, 400]] * 3] * 2
    assert fit["samples"] == 24 and fit["mean_rel_error"] >= 0 and fitted.topk == 16
    report.add_modelled(runs, fitted)
    for run in runs:
        run["ratios"] = {k: report.ratios(run["layouts"], k)
                         for k in ("tokens_per_s", "compute_bound_tokens_per_s")}  # fmt: skip
    con, dyn = runs[0]["layouts"]["contiguous"], runs[0]["layouts"]["dynamic"]
    assert con["mean_imbalance"] == pytest.approx(1.9 / 1.45) and dyn["mean_imbalance"] == 1.0
    assert con["compute_bound_tokens_per_s"] == pytest.approx(400 / 1.9)
    assert con["tokens_per_s"] == pytest.approx(400 / 2.05)  # median of the step walls
    r = runs[0]["ratios"]["compute_bound_tokens_per_s"]
    assert r["vs_contiguous"] == pytest.approx(1.9) and r["vs_head_tail"] == pytest.approx(1.3)
    (t,) = report.targets(runs)
    assert t["met"] == {"vs_contiguous": True, "vs_head_tail": True, "imbalance": True}
    # What the cost model says these very steps allow, beside the measured ratios.
    coef = np.array([fitted.linear, fitted.sparse, fitted.dense])
    busiest = {x: (np.array(s["terms"], dtype=float) @ coef).max(1).sum()
               for x, s in runs[0]["layouts"].items()}  # fmt: skip
    assert t["modelled"] == pytest.approx({"vs_contiguous": busiest["contiguous"] / busiest["dynamic"],
                                           "vs_head_tail": busiest["head_tail"] / busiest["dynamic"]})  # fmt: skip
    assert t["modelled"]["vs_head_tail"] > 1.2  # head_tail's busiest rank holds more work
    assert "the cost model gives these steps vs contiguous" in report.targets_line([t])
    table = report.markdown_measured(runs)
    assert table.startswith("| seq len | layout | step s | tokens/s | compute-bound tok/s |")
    assert "| 400 | dynamic |" in table and "1.90x | 1.30x |" in table
    report.plot_measured(runs, tmp_path / "cp.png")
    assert (tmp_path / "cp.png").read_bytes()[:8] == PNG


def test_simulate_with_a_cost_file(tmp_path, capsys):
    cost_file = tmp_path / "measured.json"
    fitted = {"linear": 5e-5, "sparse": 2e-6, "dense": 7e-8, "topk": 256}
    cost_file.write_text(json.dumps({"mode": "measured", "cost_model": fitted}))
    cost = read_cost(cost_file)
    assert cost == CostModel(**fitted)
    lengths = np.random.default_rng(0).lognormal(7, 1.5, 500).astype(np.int64) + 1
    out = tmp_path / "sim.json"
    doc = run_simulated(lengths, "test", out, ranks=(8, 16), cp=4, seq_lens=(1024,), steps=2,
                        seed=0, cost=cost, cost_source=str(cost_file))  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["rows"] == doc["rows"] and saved["cost_model"]["source"] == str(cost_file)
    assert [(r["ranks"], r["layout"]) for r in saved["rows"]] == [
        (n, x) for n in (8, 16) for x in report.LAYOUTS
    ]
    for r in saved["rows"]:
        assert r["mean_imbalance"] >= 1.0 and r["throughput"] > 0 and r["dp"] == r["ranks"] // 4
        assert (
            r["rel_throughput"] == 1.0 if r["layout"] == "contiguous" else r["rel_throughput"] > 0
        )
    assert not any("NO FITTED COST MODEL" in n for n in saved["notes"])
    assert saved["lengths"]["count"] == 500 and saved["lengths"]["max"] == int(lengths.max())
    assert (tmp_path / "sim.png").read_bytes()[:8] == PNG
    assert (tmp_path / "sim.md").read_text().startswith("| ranks | cp | seq len | layout |")
    assert "| 16 | 4 | 1024 | dynamic |" in capsys.readouterr().out


def test_simulate_without_cost_says_so_loudly(tmp_path):
    doc = run_simulated(np.array([300, 900, 5000]), "test", tmp_path / "s.json", ranks=(4,),
                        cp=4, seq_lens=(512,), steps=1, seed=0, cost=None, cost_source="")  # fmt: skip
    assert doc["notes"][0].startswith("NO FITTED COST MODEL")
    assert doc["cost_model"]["source"] == "CostModel() defaults"


def test_bad_cost_file_and_ranks_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["bench", "cp", "--simulate", "--cost", str(bad)]) == 2
    assert "not a `wanka bench cp` result" in capsys.readouterr().err
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n")
    argv = ["bench", "cp", "--simulate", "--lengths", str(lengths), "--cp", "8", "--ranks", "12"]
    assert main(argv) == 2
    assert "--ranks 12 must be a positive multiple of --cp 8" in capsys.readouterr().err


def test_index_topk_flag_is_checked_and_reaches_the_simulated_cost(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n3000\n9000\n")
    base = ["bench", "cp", "--simulate", "--lengths", str(lengths), "--cp", "2", "--ranks", "4",
            "--seq-len", "4096", "--steps", "1"]  # fmt: skip
    for bad in ("0", "-5", str((1 << 20) + 1)):
        assert main([*base, "--index-topk", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "--index-topk must be in 1..1048576" in err and len(err.splitlines()) == 1
    out = tmp_path / "sim.json"
    assert main([*base, "--index-topk", "512", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["cost_model"]["topk"] == 512
