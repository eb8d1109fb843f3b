"""`wanka launch` on bad input that test_launch_slurm / test_launch_k8s do not cover: --out
that would clobber a file wanka did not write, ranks beyond the accelerators, a --wanka that
does not parse, a relative container working directory, a Kubernetes run.dir off the --pvc
volume, Docker's `:ro` on --pvc, errors that must come before the ledger's note, and arguments
that are not UTF-8."""

from __future__ import annotations

import argparse
import os
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
    shared = ("--pvc", "cl:/data", "--set", "run.dir=/data/run")
    run = (lambda *x: slurm(tmp_path, *x)) if mode == "slurm" else (lambda *x: k8s(*shared, *x))
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


@pytest.mark.parametrize("argv, match", [
    (["--pvc", "cl:/data", "--set", "run.dir=/scratch/run"],
     "run.dir /scratch/run is not under the --pvc mount /data"),
    (["--pvc", "cl:/data", "--set", "run.dir=/database/run"], "not under the --pvc mount /data"),
    (["--pvc", "cl:/data", "--set", "run.dir=/data/../scratch/run"], "/scratch/run"),
    (["--pvc", "cl:/data", "--workdir", "/scratch"], "run.dir runs/demo \\(/scratch/runs/demo"),
    (["--pvc", "cl:/data"], "run.dir runs/demo is relative.*--workdir"),
    (["--set", "run.dir=/scratch/run"], "run.dir /scratch/run is on no shared storage.*--pvc"),
    ([], "run.dir runs/demo is on no shared storage.*--pvc"),
])  # fmt: skip
def test_k8s_run_dir_must_be_on_the_pvc(tmp_path, argv, match, capsys):
    """Each pod would otherwise write its own run directory into its container (separate
    locks, checkpoint shards split across pods), lost with the pod."""
    ledger = str(tmp_path / "no-ledger-yet.sqlite")
    with pytest.raises(ValueError, match=match) as e:
        launch("--k8s", CONFIG, "--nodes", "2", "--image", "reg/wanka:1", "--ledger", ledger,
               *argv, "--out", str(tmp_path / "x.yaml"))  # fmt: skip
    assert "\n" not in str(e.value) and not (tmp_path / "x.yaml").exists()
    assert capsys.readouterr().err == ""  # the error alone, no ledger note before it


@pytest.mark.parametrize("argv", [
    ["--pvc", "cl:/data", "--set", "run.dir=/data/runs/a"],
    ["--pvc", "cl:/data/", "--set", "run.dir=/data"],
    ["--pvc", "cl:/data", "--workdir", "/data/wanka"],  # runs/demo -> /data/wanka/runs/demo
])  # fmt: skip
def test_k8s_run_dir_under_the_pvc_is_fine(tmp_path, argv):
    assert k8s(*argv, "--out", str(tmp_path / "x.yaml")) == 0


def test_k8s_pvc_mount_path_takes_no_docker_suffix(tmp_path):
    # Docker's CLAIM:/data:ro would be mounted at "/data:ro"; a read-only run.dir cannot work.
    with pytest.raises(ValueError, match="--pvc 'cl:/data:ro': .*':'") as e:
        k8s("--pvc", "cl:/data:ro", "--out", str(tmp_path / "x.yaml"))
    assert "\n" not in str(e.value) and not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("argv, match", [
    (["--rdzv-port", "0"], "--rdzv-port must be 1-65534"),
    (["--partition", "gpu; rm -rf /"], "--partition 'gpu; rm -rf /'"),
    (["--time", "25:61:00"], "--time '25:61:00'"),
    (["--wanka", "'unclosed"], "--wanka .*No closing quotation"),
])  # fmt: skip
def test_slurm_resources_are_checked_before_the_ledger_is_read(tmp_path, argv, match, capsys):
    with pytest.raises(ValueError, match=match):
        launch("--slurm", CONFIG, "--nodes", "2", "--ledger", str(tmp_path / "none-yet.sqlite"),
               *argv)  # fmt: skip
    assert capsys.readouterr().err == ""  # one line: no "no fault ledger at ..." before it


def test_slurm_chdir_is_checked_before_the_ledger_is_read(tmp_path, monkeypatch, capsys):
    (tmp_path / "a dir").mkdir()
    monkeypatch.chdir(tmp_path / "a dir")
    with pytest.raises(ValueError, match="sbatch's --chdir"):
        launch("--slurm", CONFIG, "--nodes", "2", "--ledger", str(tmp_path / "none-yet.sqlite"))
    assert capsys.readouterr().err == ""


def test_k8s_wanka_is_checked_before_the_ledger_is_read(tmp_path, capsys):
    with pytest.raises(ValueError, match="--wanka"):
        launch("--k8s", CONFIG, "--nodes", "2", "--image", "reg/wanka:1", "--pvc", "cl:/data",
               "--set", "run.dir=/data/run", "--ledger", str(tmp_path / "none-yet.sqlite"),
               "--wanka", "'unclosed")  # fmt: skip
    assert capsys.readouterr().err == ""


BAD = os.fsdecode(b"bad\xff.toml")  # a file name that is not UTF-8, as Python hands it over


@pytest.mark.parametrize("mode", ["slurm", "k8s"])
@pytest.mark.parametrize("where", ["config", "set", "out"])
def test_an_argument_that_is_not_utf8_is_named_in_one_line(tmp_path, monkeypatch, mode, where):
    monkeypatch.chdir(tmp_path)
    shutil.copy(CONFIG, BAD)
    config = BAD if where == "config" else CONFIG
    out = str(tmp_path / (os.fsdecode(b"out\xff") if where == "out" else "x.out"))
    extra = ["--set", f"run.dir=/data/{BAD}"] if where == "set" else []
    argv = ["--slurm", config] if mode == "slurm" else ["--k8s", config, "--image", "reg/w:1",
                                                        "--pvc", "cl:/data", "--set",
                                                        "run.dir=/data/run"]  # fmt: skip
    with pytest.raises(ValueError, match="not valid UTF-8") as e:
        launch(*argv, "--nodes", "2", "--ledger", "none", *extra, "--out", out)
    flag = {"config": "the config path", "set": "--set", "out": "--out"}[where]
    assert str(e.value).startswith(f"{flag} ") and "\\xff" in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and not Path(out).exists()
