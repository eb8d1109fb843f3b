"""Paths a config points at that cannot be folders, and torchrun counts that make no sense: one
line and exit 2 before any rank starts, never a traceback."""

import pytest

from wanka.cli import main


def _one_line(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_file_in_the_way_of_cache_dir_or_ledger(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    base = ["train", "--set", "train.steps=1", "--set", "parallel.ep=1",
            "--set", f'run.dir="{tmp_path / "run"}"']  # fmt: skip
    _one_line(capsys, [*base, "--set", f'data.cache_dir="{blocker}"'],
              "data.cache_dir=")  # fmt: skip
    _one_line(capsys, [*base, "--set", f'resilience.ledger="{blocker / "x.sqlite"}"'],
              "set resilience.ledger to a path in a writable directory")  # fmt: skip
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("value", ["0", "1:0", "2:1", "abc", "1:2:3", "-1"])
def test_bad_nnodes_is_refused_by_the_parser(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["train", "--nnodes", value])
    assert e.value.code == 2
    assert "argument --nnodes" in capsys.readouterr().err


def test_bad_node_rank_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--node-rank", "-1"])
    assert "argument --node-rank" in capsys.readouterr().err
