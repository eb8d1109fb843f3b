"""Bad environment and lab flags: one line, exit 2, before anything runs.

Found by a fuzzing review: OMP_NUM_THREADS=abc under the supervisor made every rank fail to
start (three restarts, six startup faults counted against a healthy node); `wanka lab` took
--memory-gib 0 as "no memory limit", --repeats 0 failed every candidate, and a --db that is
not a lab history was a sqlite traceback."""

from __future__ import annotations

import pytest

from wanka.cli import main


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4,2", "1.5"])
def test_a_bad_omp_num_threads_is_one_line_before_any_rank(value, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    rc = main(["train", "configs/demo.toml", "--set", f'run.dir="{tmp_path / "run"}"'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"OMP_NUM_THREADS={value!r} is not a positive whole number" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--memory-gib", "0"], "--memory-gib 0.0 is out of range"),
    (["--timeout", "-1"], "--timeout -1.0 is out of range"),
    (["--timeout", "nan"], "--timeout nan is out of range"),
    (["--repeats", "0"], "--repeats 0 is out of range"),
])  # fmt: skip
def test_lab_evaluation_limits_are_checked(flags, needle, tmp_path, capsys):
    src = tmp_path / "k.py"
    src.write_text("from wanka.lab.tasks.rmsnorm import reference as kernel  # noqa: F401\n")
    rc = main(["lab", "eval", "rmsnorm-cpu", str(src), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_a_db_that_is_not_a_lab_history_is_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.toml"
    garbage.write_text("[not]\nsqlite = 1\n" * 200)
    assert main(["lab", "report", "--db", str(garbage)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a usable lab history" in err and len(err.splitlines()) == 1, err
    assert garbage.read_text().startswith("[not]")  # untouched
    assert main(["lab", "report", "--db", str(tmp_path)]) == 2  # a folder
    assert f"--db {tmp_path} is not a usable lab history" in capsys.readouterr().err
