"""`wanka launch` on bad input that test_launch_slurm / test_launch_k8s do not cover: --out
that would clobber a file wanka did not write, ranks beyond the accelerators, a --wanka that
does not parse, a relative container working directory."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from wanka.launch.cli import add_launch_parser

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/demo.toml")


def launch(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="wanka")
    add_launch_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["launch", *argv])
    a.argv = ["launch", *argv]
    return a.fn(a)


def slurm(tmp_path: Path, *extra: str) -> int:
    return launch("--slurm", CONFIG, "--nodes", "2", "--ledger", "none",
                  "--set", f'run.dir="{tmp_path / "run"}"', *extra)  # fmt: skip


def k8s(*extra: str) -> int:
    return launch("--k8s", CONFIG, "--nodes", "2", "--image", "reg/wanka:1", "--ledger", "none",
                  *extra)  # fmt: skip


@pytest.mark.parametrize("mode", ["slurm", "k8s"])
def test_out_replaces_only_what_wanka_launch_wrote(tmp_path, mode):
    run = (lambda *x: slurm(tmp_path, *x)) if mode == "slurm" else k8s
    out = tmp_path / "job.out"
    assert run("--out", str(out)) == 0
    first = out.read_text()
    assert run("--out", str(out), "--nodes", "4") == 0  # a refresh: its own file, replaced
    assert out.read_text() != first
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    with pytest.raises(ValueError, match="not written by wanka launch") as e:
        run("--out", str(mine))
    assert "\n" not in str(e.value) and mine.read_text() == "my notes\n"
    with pytest.raises(ValueError, match="is a directory"):
        run("--out", str(tmp_path))


def test_out_is_never_the_config(tmp_path):
    cfg = tmp_path / "job.toml"
    shutil.copy(CONFIG, cfg)
    text = cfg.read_text()
    with pytest.raises(ValueError, match="is the config file itself"):
        launch("--slurm", str(cfg), "--nodes", "2", "--ledger", "none", "--out", str(cfg))
    assert cfg.read_text() == text


@pytest.mark.parametrize("argv, match", [
    (["--gpus-per-node", "2", "--nproc", "4"], "--nproc 4 ranks per node but --gpus-per-node 2"),
    (["--gpus-per-node", "-2"], "--gpus-per-node must be 0 or more"),  # not a parallel-degree error
    (["--wanka", "'unclosed"], "--wanka .*No closing quotation"),
])  # fmt: skip
def test_bad_slurm_input_is_one_line(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match) as e:
        slurm(tmp_path, "--set", "parallel.ep=1", *argv, "--out", str(tmp_path / "x.sbatch"))
    assert "\n" not in str(e.value) and not (tmp_path / "x.sbatch").exists()


def test_k8s_workdir_must_be_absolute(tmp_path):
    with pytest.raises(ValueError, match="--workdir 'data dir'.*absolute"):
        k8s("--workdir", "data dir", "--out", str(tmp_path / "x.yaml"))
    assert not (tmp_path / "x.yaml").exists()
