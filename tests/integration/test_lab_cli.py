"""`wanka lab ...` end to end through wanka's main (tasks, run, report, export, eval), and the
one-line errors for bad input."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types

import pytest

from wanka import cli
from wanka.lab.cli import add_lab_parser


@pytest.fixture(autouse=True)
def lab_wired(monkeypatch):
    """Use wanka's real main; add the `lab` command if cli.py does not wire it (yet)."""
    build = cli.build_parser

    def with_lab():
        p = build()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        if "lab" not in sub.choices:
            add_lab_parser(sub)
        return p

    monkeypatch.setattr(cli, "build_parser", with_lab)


def isolation(monkeypatch, reason: str | None) -> None:
    """Stand-in wanka.lab.sandbox whose unavailable_reason() says `reason`."""
    mod = types.ModuleType("wanka.lab.sandbox")
    mod.unavailable_reason = lambda: reason
    monkeypatch.setitem(sys.modules, "wanka.lab.sandbox", mod)


LLM = ["--proposer", "llm", "--llm-url", "http://127.0.0.1:9/v1", "--llm-model", "m"]


def test_tasks_lists_every_op(capsys):
    assert cli.main(["lab", "tasks"]) == 0
    out = capsys.readouterr().out
    for name in ("sparse_attention-cpu", "sparse_attention-triton", "lightning_indexer-cpu",
                 "dense_attention-cpu", "dense_attention-triton", "rmsnorm-cpu",
                 "rmsnorm-triton", "rope-cpu", "moe_dispatch-cpu"):  # fmt: skip
        assert name in out


def test_run_report_export_eval(tmp_path, capsys, monkeypatch):
    isolation(monkeypatch, "no user namespaces")  # search (trusted templates) runs anyway
    db = str(tmp_path / "h.sqlite")
    summary = tmp_path / "run.json"
    rc = cli.main(["lab", "run", "rope-cpu", "--proposer", "search", "--budget", "3",
                   "--db", db, "--repeats", "3", "--json", str(summary)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "[3/3]" in out and "rope-cpu: 3 evaluations" in out
    s = json.loads(summary.read_text())
    assert s["evaluations"] == 3 and s["best"]["speedup"] > 0
    png = tmp_path / "curve.png"
    assert cli.main(["lab", "report", "--db", db, "--png", str(png)]) == 0
    rep = capsys.readouterr().out
    assert "rope-cpu" in rep and "fast_p" in rep and png.exists()
    mod = tmp_path / "rope_lab.py"
    assert (
        cli.main(["lab", "export", "rope-cpu", "--db", db, "--out", str(mod), "--repeats", "3"])
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert len(line.splitlines()) == 1 and "held-out re-check" in line and "x;" in line, line
    spec = importlib.util.spec_from_file_location("rope_lab_cli", mod)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from wanka.ops import registry

    assert "lab" in registry.backends("rope")
    cand = tmp_path / "cand.py"
    cand.write_text("from wanka.models.layers import apply_rope as kernel  # noqa: F401\n")
    argv = ["lab", "eval", "rope-cpu", str(cand), "--repeats", "3"]
    assert cli.main(argv) == 2  # a user's file is untrusted: refused without isolation
    err = capsys.readouterr().err.strip()
    assert "refusing to run candidate file" in err and "no user namespaces" in err
    assert len(err.splitlines()) == 1
    assert cli.main([*argv, "--unsafe-no-isolation"]) == 0
    assert "correct" in capsys.readouterr().out


def test_llm_proposer_needs_isolation_or_the_unsafe_flag(tmp_path, capsys, monkeypatch):
    isolation(monkeypatch, "no user namespaces")
    argv = ["lab", "run", "rope-cpu", "--budget", "2", *LLM, "--db", str(tmp_path / "h.sqlite")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert ("refusing to run proposer llm without OS isolation (no user namespaces); pass "
            "--unsafe-no-isolation to run it anyway") in err  # fmt: skip
    # with the flag it goes on, and stops at the (unreachable) endpoint, not at isolation
    assert cli.main([*argv, "--unsafe-no-isolation"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unreachable" in err and "isolation" not in err, err
    # isolation available: no flag needed; a missing sandbox module counts as unavailable
    isolation(monkeypatch, None)
    assert cli.main(argv) == 2 and "unreachable" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "wanka.lab.sandbox", None)  # import raises ImportError
    assert cli.main(argv) == 2
    assert "(wanka.lab.sandbox missing)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["lab", "run", "no_such_task", "--budget", "2"], "unknown task 'no_such_task'"),
        (["lab", "run", "rope-cpu", "--budget", "zero"], "--budget must be a positive integer"),
        (["lab", "run", "rope-cpu", "--budget", "-3"], "--budget must be a positive integer"),
        (["lab", "run", "rope-cpu", "--budget", "2", *LLM, "--unsafe-no-isolation"], "unreachable"),
        (["lab", "run", "rope-cpu", "--budget", "2", "--proposer", "magic"], "unknown proposer"),
        (["lab", "report", "--db", "/nonexistent/h.sqlite"], "no lab history"),
        (["lab", "export", "rope-cpu", "--db", "/nonexistent/h.sqlite"], "no lab history"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, msg, tmp_path, capsys):
    if "--db" not in argv:
        argv = [*argv, "--db", str(tmp_path / "h.sqlite")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_triton_task_without_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    argv = ["lab", "run", "rmsnorm-triton", "--budget", "2", "--db", str(tmp_path / "h.sqlite")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be timed here: needs a CUDA GPU" in err and len(err.splitlines()) == 1
