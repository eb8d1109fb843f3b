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


def test_an_unknown_op_in_run_ops_backend_is_refused_not_ignored(capsys):
    """`run.ops_backend=sparse_atention=reference` (a typo) trained on the default backend,
    and `wanka check` said "ready to launch" for a backend train then refused."""
    from wanka.ops.registry import check_forced

    with pytest.raises(
        ValueError, match="no op 'sparse_atention'; did you mean 'sparse_attention'"
    ):
        check_forced("sparse_atention=reference")
    with pytest.raises(ValueError, match="has no backend 'nonexistent'; it has .*reference"):
        check_forced("sparse_attention=nonexistent")
    check_forced("sparse_attention=reference, lightning_indexer=cpu")
    check_forced("*=reference")
    rc = main(["check", "configs/demo.toml", "--set", 'run.ops_backend="foo=bar"'])
    out = capsys.readouterr()
    assert rc != 0 and "there is no op 'foo'" in out.out + out.err, out


def test_a_reader_that_stops_early_is_no_traceback():
    """`wanka model | head -2` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "wanka.cli", "model", "tiny"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    p.stdout.close()  # the reader leaves before the first line: every write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err, err


def test_a_drill_of_no_ranks_is_one_line(tmp_path, capsys):
    assert main(["chaos", "drill", "--out", str(tmp_path / "d"), "--nproc", "0"]) == 2
    assert "--nproc must be 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_folder_or_fifo_where_a_file_belongs_is_named_as_such(tmp_path, capsys):
    """A FIFO as the config was "no such config file" (it exists); a folder of prompts was
    "no prompts file DIR"; wanka clean took --max-age-h -1 and nan."""
    import os

    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    assert main(["check", str(fifo)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompts", str(tmp_path)]) == 2
    assert f"prompts file {tmp_path} is a folder" in capsys.readouterr().err
    for bad in ("-1", "nan", "0"):
        assert main(["clean", "--max-age-h", bad]) == 2
        assert "is not a positive number of hours" in capsys.readouterr().err
