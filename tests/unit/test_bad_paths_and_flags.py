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
    for port in ("abc", "0", "70000"):  # torchrun printed its own 19-line usage for these
        with pytest.raises(SystemExit):
            main(["train", "--master-port", port])
        assert f"argument --master-port: '{port}' is not a port" in capsys.readouterr().err


def test_config_files_as_editors_save_them(tmp_path):
    from wanka.config import ConfigError, load_config

    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")  # Windows Notepad's UTF-8
    assert load_config(bom).train.steps == 3
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(tmp_path)
    home = load_config(None, ["data.path=~/corpus", "run.dir=~/runs/x"])
    assert not home.data.path.startswith("~") and home.run.dir.endswith("/runs/x")


def test_utf16_text_and_a_run_dir_as_checkpoint_are_named(tmp_path, capsys):
    from wanka.data.prepare import main_prepare

    utf16 = tmp_path / "notes.txt"
    utf16.write_bytes("hello\r\n".encode("utf-16"))
    assert main_prepare([str(utf16)], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "is UTF-16 text" in capsys.readouterr().err
    from wanka.train.checkpoint import Checkpointer

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    with pytest.raises(ValueError, match="is a run directory, not one of its checkpoints"):
        Checkpointer.load(object.__new__(Checkpointer), run, {})


def test_dp_shard_message_names_only_the_bad_degree():
    from wanka.config import load_config
    from wanka.distributed.parallel_dims import ParallelDims, ParallelError

    with pytest.raises(ParallelError, match=r"dp_shard=-7 must be positive, or -1") as e:
        ParallelDims.from_config(load_config(None, ["parallel.dp_shard=-7"]).parallel, 4)
    assert "parallel.ep" not in str(e.value)


def test_chaos_rank_beyond_the_job_is_refused():
    from wanka.resilience.chaos import parse_schedule

    assert parse_schedule("kill@step=1,rank=1", world=2)[0].rank == 1
    for spec in ("kill@step=1,rank=7", "stop@step=2,rank=-1"):
        with pytest.raises(ValueError, match=r"the job has 2 rank\(s\): 0..1"):
            parse_schedule(spec, world=2)


def test_chaos_without_the_supervisor_is_refused(tmp_path, capsys):
    _one_line(capsys, ["train", "--chaos", "kill@step=1", "--set", "resilience.supervise=false",
                       "--set", "parallel.ep=1", "--set", f'run.dir="{tmp_path / "r"}"'],
              "--chaos needs the supervisor")  # fmt: skip


def test_set_takes_what_a_shell_user_means():
    from wanka.config import ConfigError, load_config

    cfg = load_config(None, ["run.dir=2024-01-01", "train.lr=.003", "train.min_lr_ratio=1."])
    assert cfg.run.dir == "2024-01-01" and cfg.train.lr == 0.003 and cfg.train.min_lr_ratio == 1.0
    assert load_config(None, ["run.dir=.5", "data.path=5."]).run.dir == ".5"  # text stays text
    assert type(cfg.run.dir) is str
    with pytest.raises(ConfigError, match="train.lr"):  # still a string, still refused
        load_config(None, ["train.lr=fast"])


@pytest.mark.parametrize(
    "env, calls",
    [
        ({}, 2),
        ({"WANKA_HOST_MALLOC": "default"}, 0),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, 0),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, 0),
    ],  # fmt: skip
)
def test_host_malloc_tuning_yields_to_explicit_settings(monkeypatch, env, calls):
    """`wanka bench memory` pins glibc's mmap threshold so RSS follows the allocations: the
    trainer's own tuning must not override it (it inflated the measured peaks by 33-50%)."""
    import wanka.device as device

    for k in ("WANKA_HOST_MALLOC", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    made = []

    class Libc:
        def mallopt(self, *args):
            made.append(args)

    monkeypatch.setattr(device.ctypes, "CDLL", lambda *a: Libc())
    device.keep_freed_host_memory()
    assert len(made) == calls


def test_check_without_nproc_checks_the_world_train_would_start(capsys):
    """`wanka train configs/demo.toml` starts the smallest world its degrees fit (ep = 2: two
    ranks); `wanka check` used to assume one rank and failed the demo's own config."""
    assert main(["check", "configs/demo.toml", "--no-live"]) == 0, capsys.readouterr()
    assert "ready to launch" in capsys.readouterr().out


def test_bench_train_rank_counts_are_checked_first(capsys):
    """--nprocs abc was "invalid literal for int()"; --nprocs 0 ran every case to FAILED."""
    for bad in ("abc", "0", "1,-2"):
        assert main(["bench", "train", "--nprocs", bad]) == 2
        assert "give positive whole numbers" in capsys.readouterr().err


def test_model_flavor_given_twice_or_a_sequence_it_cannot_hold_is_refused(capsys):
    """`wanka model tiny --set model.flavor=small` reported small; `--seq-len 99999999`
    printed a 63 TB estimate for a length training refuses."""
    assert main(["model", "tiny", "--set", "model.flavor=small"]) == 2
    assert "the flavor is given twice" in capsys.readouterr().err
    assert main(["model", "tiny", "--seq-len", "99999999"]) == 2
    assert "> model.max_seq_len=" in capsys.readouterr().err
