"""`wanka bench comm` without a cluster: flags, cases, counters, per-step bytes, ratios and
tables, on synthetic records (no rank starts)."""

from __future__ import annotations

import json
import time

import pytest

from wanka.bench import comm_report as report
from wanka.bench.comm import check_cases, run_bench
from wanka.bench.comm_cases import (
    BASELINE,
    DEFAULT_CASES,
    Case,
    parse_case_spec,
    parse_gbit,
    parse_steps,
    select_cases,
)
from wanka.bench.comm_counters import CounterSampler, bytes_at, read_sent, window_per_step
from wanka.bench.comm_run import read_metrics, run_sets, train_argv
from wanka.cli import main


def test_default_cases_baseline_first_and_always_run():
    names = [c.name for c in select_cases(None)]
    assert names == list(DEFAULT_CASES) and names[0] == BASELINE
    assert [c.name for c in select_cases("hsdp_int8")] == [BASELINE, "hsdp_int8"]
    assert [c.name for c in select_cases("flat_bf16,flat_fp32,flat_bf16")] == [
        BASELINE,
        "flat_bf16",
    ]
    by = {c.name: c for c in select_cases(",".join(DEFAULT_CASES))}
    assert by["hsdp_fp32"].sets == ["parallel.dp_replicate=2"]
    assert by["hsdp_powersgd"].sets == ["parallel.dp_replicate=2", "comm.grad_compression=powersgd"]
    assert (by["hsdp_int8"].val_tolerance, by["hsdp_powersgd"].val_tolerance) == (0.01, 0.03)


def test_case_errors_are_one_line():
    with pytest.raises(ValueError, match="unknown case 'hsdp_fp16' in --cases: known are"):
        select_cases("flat_fp32,hsdp_fp16")
    with pytest.raises(ValueError, match="--cases is empty"):
        select_cases(" , ")
    with pytest.raises(ValueError, match="bad --case"):
        parse_case_spec("no colon")
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_case_spec("x:train.reduce_dtype")


def test_custom_case_joins_the_selection():
    c = parse_case_spec("best: parallel.dp_replicate=2 , comm.grad_compression=int8,")
    assert c == Case("best", (("parallel.dp_replicate", "2"), ("comm.grad_compression", "int8")),
                     "custom (--case)")  # fmt: skip
    got = select_cases("flat_bf16", ["mine:train.reduce_dtype=bf16"])
    assert [x.name for x in got] == [BASELINE, "flat_bf16", "mine"]


@pytest.mark.parametrize("text,want", [("1,10", (1.0, 10.0)), (" 0.5 ", (0.5,))])
def test_parse_gbit(text, want):
    assert parse_gbit(text) == want


@pytest.mark.parametrize("text,why", [("1,x", "not a number"), ("0", "0.001 to 1000"),
                                      ("-1", "0.001 to 1000"), ("inf", "0.001 to 1000"),
                                      ("2000", "0.001 to 1000"), ("0.0001", "0.001 to 1000"),
                                      ("1,1", "listed twice"), ("", "not a number")])  # fmt: skip
def test_parse_gbit_rejects(text, why):
    with pytest.raises(ValueError, match=why):
        parse_gbit(text)


def test_parse_steps():
    assert parse_steps("4,12") == (4, 12)
    for bad in ("4", "12,4", "0,3", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="bad --steps"):
            parse_steps(bad)


def _sysfs(root, sent: dict[str, int]) -> None:
    for dev, n in sent.items():
        d = root / dev / "statistics"
        d.mkdir(parents=True, exist_ok=True)
        (d / "rx_bytes").write_text(f"{n}\n")


def test_counters_read_the_host_side_rx(tmp_path):
    _sysfs(tmp_path, {"wkc-n0h": 100, "wkc-n1h": 250})
    assert read_sent({"n0": "wkc-n0h", "n1": "wkc-n1h"}, tmp_path) == {"n0": 100, "n1": 250}
    with CounterSampler({"n0": "wkc-n0h"}, interval=0.01, root=tmp_path) as s:
        time.sleep(0.05)
        _sysfs(tmp_path, {"wkc-n0h": 400})
        time.sleep(0.05)
    assert s.samples[0][1] == 100 and s.samples[-1][1] == 400
    assert all(a[0] <= b[0] for a, b in zip(s.samples, s.samples[1:]))


def test_window_interpolates_between_samples():
    samples = [(10.0, 0), (11.0, 1000), (13.0, 1000), (14.0, 3000)]
    assert bytes_at(samples, 10.5) == 500 and bytes_at(samples, 99) == 3000
    assert bytes_at(samples, 0) == 0
    logged = {2: 10.5, 6: 13.5}  # 4 steps between the two rows
    assert window_per_step(samples, logged, 2, 6) == (2000 - 500) / 4
    assert window_per_step(samples, logged, 2, 7) is None


def _run(steps: int, rep: int, per_step: float, start: float, t: float = 0.5) -> dict:
    """A synthetic run: `start` bytes of start-up per node, then per_step per node per step."""
    sent = {n: int(start + per_step * steps) for n in ("n0", "n1")}
    return {"steps": steps, "repeat": rep, "sent": sent, "step_time_s": [t] * (steps - 1),
            "tokens_per_s": [512 / t] * (steps - 1), "window_bytes_per_step": 2 * per_step}  # fmt: skip


def test_summary_differences_out_the_startup():
    runs = [_run(3, 0, 1000, 5e6), _run(6, 0, 1000, 5e6), _run(3, 1, 1000, 6e6),
            _run(6, 1, 1000, 6e6 + 300)]  # fmt: skip
    s = report.summarise_case(runs, 3, 6, gbit=1.0)
    assert s["error"] is None and s["bytes_per_step_repeats"] == [2000, 2200]
    assert s["bytes_per_step"] == 2100 and s["bytes_spread"] == pytest.approx(200 / 2100)
    assert s["sent_per_step_by_node"] == {"n0": 1050, "n1": 1050}
    assert s["step_time_s"] == 0.5 and s["tokens_per_s"] == 1024
    assert s["link_s_per_step"] == pytest.approx(1050 / 125e6)
    assert report.summarise_case(runs[:1], 3, 6, 1.0)["error"].startswith("no complete")
    failed = report.summarise_case([], 3, 6, 1.0, "exit 2: bad key")
    assert failed["error"] == "exit 2: bad key" and failed["bytes_per_step"] is None


def _doc(with_conv: bool = True) -> dict:
    def link(gbit: float, t_hsdp: float) -> dict:
        cases = {BASELINE: report.summarise_case([_run(3, 0, 1e6, 1e7), _run(6, 0, 1e6, 1e7)], 3, 6, gbit),
                 "hsdp_int8": report.summarise_case([_run(3, 0, 1e5, 1e7, t_hsdp),
                                                     _run(6, 0, 1e5, 1e7, t_hsdp)], 3, 6, gbit),
                 "hsdp_bf16": report.summarise_case([], 3, 6, gbit, "exit 2: unknown key")}  # fmt: skip
        report.add_ratios(cases)
        return {"gbit": gbit, "cases": cases}

    links = [link(1.0, 0.25), link(10.0, 0.6)]
    doc = {"cases": [{"name": n} for n in (BASELINE, "hsdp_int8", "hsdp_bf16")], "links": links,
           "best": report.best(links), "date": "2026-01-01", "command": "wanka bench comm",
           "machine": {"cpus": 2, "cpu_model": "x"},
           "setup": {"nodes": 2, "nproc_per_node": 2, "steps": [3, 6], "repeats": 1,
                     "warmup_steps": 1, "measure_shape": {}}}  # fmt: skip
    if with_conv:
        conv = {BASELINE: {"val_loss": 4.0, "tolerance": 0.01},
                "hsdp_int8": {"val_loss": 4.02, "tolerance": 0.01},
                "hsdp_bf16": {"error": "exit 2", "tolerance": 0.01}}  # fmt: skip
        report.add_convergence_diffs(conv)
        doc["convergence"] = {
            "steps": 200,
            "where": "here",
            "shape": {},
            "cases": conv,
            "wall_s": 60,
        }
    return doc


def test_ratios_best_and_convergence():
    doc = _doc()
    one = doc["links"][0]["cases"]
    assert one["hsdp_int8"]["ratios"]["bytes_per_step"] == pytest.approx(0.1)
    assert one["hsdp_int8"]["ratios"]["step_time_s"] == 0.5
    assert one["hsdp_bf16"]["ratios"] == dict.fromkeys(
        ("bytes_per_step", "step_time_s", "tokens_per_s")
    )
    assert doc["best"] == {"1": "hsdp_int8", "10": BASELINE}
    conv = doc["convergence"]["cases"]
    assert conv["hsdp_int8"]["rel_diff"] == pytest.approx(0.005) and conv["hsdp_int8"]["met"]
    assert conv[BASELINE]["met"] and conv["hsdp_bf16"]["met"] is None
    assert [n for n, _ in report.failures(doc)] == ["hsdp_bf16"]


def test_markdown_side_by_side():
    md = report.markdown(_doc())
    head = md.splitlines()[0]
    assert (
        "fewer bytes than flat" in head
        and "speed-up vs flat @1G" in head
        and "speed-up vs flat @10G" in head
    )
    assert "| hsdp_int8 | 0.20 | 10.00x | 0.250 | 2.00x | 2,048 | 0.600 | 0.83x |" in md
    assert "| 4.0200 | +0.500% | ±1% met |" in md
    assert "| hsdp_bf16 | - | - |" in md and "best (shortest step): 1 Gbit/s hsdp_int8" in md
    assert "val loss" not in report.markdown(_doc(with_conv=False))


def test_read_metrics_and_run_sets(tmp_path):
    rows = [{"kind": "train", "step": s, "time": 100.0 + s, "step_time": 0.1 * s,
             "tokens_per_s": 10.0 * s} for s in (1, 2, 3)]  # fmt: skip
    rows.append({"kind": "eval", "step": 3, "time": 104.0, "val_loss": 4.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = read_metrics(tmp_path, warmup=1)
    assert m["step_time_s"] == pytest.approx([0.2, 0.3]) and m["tokens_per_s"] == [20.0, 30.0]
    assert m["logged_at"] == {1: 101.0, 2: 102.0, 3: 103.0} and m["val_loss"] == 4.5
    sets = run_sets({"data.seq_len": "64"}, 6, tmp_path, ["x.y=1"], ["data.seq_len=32"])
    assert "checkpoint.enable=false" in sets and "train.steps=6" in sets
    assert sets[-2:] == ["x.y=1", "data.seq_len=32"]  # the user's --set wins
    argv = train_argv("c.toml", ["a=1"], 2, "/st")
    assert argv[-8:] == [
        "c.toml",
        "--nproc",
        "2",
        "--cluster",
        "--cluster-state",
        "/st",
        "--set",
        "a=1",
    ]
    assert "--cluster" not in train_argv(None, [], 4, None)


def _opts(**kw) -> dict:
    return {"config": None, "sets": [], "gbits": (1.0,), "steps": (3, 6), "converge_steps": 0,
            "warmup": 1, **kw}  # fmt: skip


def test_check_cases_names_the_case():
    check_cases([Case(BASELINE), Case("flat_bf16", (("train.reduce_dtype", "bf16"),))], _opts())
    with pytest.raises(ValueError, match="^case bogus: .*leave it out with --cases"):
        check_cases([Case("bogus", (("train.no_such_key", "1"),))], _opts(converge_steps=5))


def test_no_testbed_is_one_line(monkeypatch):
    monkeypatch.setattr("wanka.cluster.netns.missing_requirements", lambda: "needs root")
    with pytest.raises(ValueError, match="needs the cluster testbed: needs root"):
        run_bench([Case(BASELINE)], _opts(nodes=2, nproc_per_node=2, repeats=1, argv=[]))


@pytest.mark.parametrize("argv,why", [
    (["--cases", "nope"], "unknown case 'nope'"), (["--gbit", "1,fast"], "bad --gbit"),
    (["--gbit", "none"], "nothing to measure"), (["--steps", "5,3"], "bad --steps"),
    (["--warmup", "3", "--steps", "3,6"], "--warmup 3"), (["--repeats", "0"], "--repeats"),
    (["--case", "x"], "bad --case"), (["--table", "/no/such.json"], "no such file"),
    # 200000 local ranks filled the memory (the bench's runs skip the pre-flight)
    (["--nproc-per-node", "100000"], "--nproc-per-node 100000: this machine has"),
    (["--gbit", "2000"], "bad --gbit '2000'"),  # named --link-gbit, after a run dir was made
    (["--out", "/"], "--out / is a directory"),  # found after the whole benchmark before
])  # fmt: skip
def test_cli_bad_flags_exit_2_with_one_line(argv, why, capsys):
    assert main(["bench", "comm", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("wanka bench: ") and why in err and "\n" not in err


def test_cli_table_prints_an_earlier_result(tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(_doc()))
    assert main(["bench", "comm", "--table", str(tmp_path / "c.json")]) == 0
    assert "| hsdp_int8 | 0.20 | 10.00x |" in capsys.readouterr().out


def test_convergence_verdict_tells_a_lower_loss_from_a_higher_one():
    cases = {BASELINE: {"val_loss": 2.0, "tolerance": 0.01},
             "hsdp_bf16": {"val_loss": 1.94, "tolerance": 0.01},
             "hsdp_int8": {"val_loss": 2.06, "tolerance": 0.01},
             "hsdp_powersgd": {"val_loss": 2.05, "tolerance": 0.03}}  # fmt: skip
    report.add_convergence_diffs(cases)
    assert [cases[n]["met"] for n in cases] == [True, False, False, True]
    assert [cases[n]["verdict"] for n in cases] == ["met", "lower", "MISSED", "met"]


def test_bench_ep_checks_out_before_it_runs(tmp_path, capsys):
    assert main(["bench", "ep", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a directory" in err and "\n" not in err


def test_sigterm_ends_a_bench_through_its_finally_blocks():
    import os
    import signal

    from wanka.bench.output import sigterm_as_exit

    cleaned = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with sigterm_as_exit():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pause()
            finally:
                cleaned.append("testbed down")
    assert e.value.code == 143 and cleaned == ["testbed down"]
    assert signal.getsignal(signal.SIGTERM) is before
