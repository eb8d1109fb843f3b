"""`wanka export` / `wanka import` when writing fails or the input cannot be what it claims:
a full disk, writer errors, NaN weights, file modes, tokenizers that do not fit the model,
two commands writing one --out at once. One line, exit 2, nothing lost or left behind."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import types
import warnings

import pytest
import torch

from wanka.cli import main
from wanka.resilience.chaos import fill_disk, small_filesystem, tmpfs_unavailable

from .tiny_hf import CFG, write_tiny_hf

NO_TMPFS = tmpfs_unavailable()
needs_tmpfs = pytest.mark.skipif(NO_TMPFS is not None, reason=f"no tmpfs: {NO_TMPFS}")
EXPORT_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_tiny_hf(tmp_path_factory.mktemp("hf") / "hf")


@pytest.fixture(scope="module")
def run_dir(hf_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "run"
    assert main(["import", str(hf_dir), "--out", str(run)]) == 0
    return run


def one_line_error(capsys, argv: list[str], fragment: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err
    return err


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- a full disk ---------------------------------------------------------------------------


@needs_tmpfs
@pytest.mark.parametrize("cmd", ["export", "import"])
def test_a_full_disk_is_one_line_and_leaves_no_folder(cmd, hf_dir, run_dir, tmp_path, capsys):
    """The export used to end in a bare SafetensorError ("No space left on device"), the import
    in DCP's error; both left the --out folder they had created (empty) behind."""
    src = run_dir if cmd == "export" else hf_dir
    with small_filesystem(tmp_path / "disk", 1) as disk:
        fill_disk(disk, 100_000, 1 << 30)  # the small files fit, the 200 KiB of weights do not
        mine = disk / "mine"
        mine.mkdir()
        for out in (disk / "new" / "out", mine):  # created by the command; the user's own
            err = one_line_error(capsys, [cmd, str(src), "--out", str(out)], "cannot write --out")
            assert "No space left on device; free space or choose another folder" in err
        assert _names(disk) == [".chaos-ballast", "mine"]  # new/out went, parent and all
        assert _names(mine) == []


def _safetensors_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                          "error 28)")  # fmt: skip


def _dcp_unexpected_pos(*args, **kwargs):
    """What DCP's save raises when torch's zip writer meets a full disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1024")
    raise CheckpointException("write", {0: (err, None)})


def test_writer_errors_are_one_line_everywhere(hf_dir, run_dir, tmp_path, monkeypatch, capsys):
    """The same without a tmpfs: the writers' own exception types, as a full disk makes them."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    import wanka.train.checkpoint as ckpt

    monkeypatch.setattr(safetensors.torch, "save_file", _safetensors_full)
    err = one_line_error(capsys, ["export", str(run_dir), "--out", str(tmp_path / "hf")],
                         "cannot write --out")  # fmt: skip
    assert "No space left on device; free space" in err
    monkeypatch.setattr(dcp, "save", _dcp_unexpected_pos)
    err = one_line_error(capsys, ["import", str(hf_dir), "--out", str(tmp_path / "run")],
                         "cannot write --out")  # fmt: skip
    assert "unexpected pos" in err and "check that disk" in err  # the disk is not full: as is
    # On a full disk it is named as one (the zip writer's message does not say so).
    full = types.SimpleNamespace(total=1 << 20, used=1 << 20, free=0)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: full)
    err = one_line_error(capsys, ["import", str(hf_dir), "--out", str(tmp_path / "run")],
                         "No space left on device")  # fmt: skip
    assert "free space or choose another folder" in err
    assert _names(tmp_path) == []


# -- what export writes ----------------------------------------------------------------------


def _diverged_copy(run_dir, tmp_path, name: str):
    """A copy of the run with a step-1 checkpoint holding a NaN (step 0 stays finite)."""
    import torch.distributed.checkpoint as dcp

    from wanka.infer.load import load_trained
    from wanka.train.checkpoint import step_dir, write_manifest

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    model, cfg, _ = load_trained(run)
    sd = model.state_dict()
    sd[name].view(-1)[3] = float("nan")
    model_json = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True)
    ck = step_dir(run / "checkpoints", 1)
    state = {"model": sd,
             "train": {"step": 1, "rng": torch.get_rng_state(), "model_config": model_json}}  # fmt: skip
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(ck), no_dist=True)
    write_manifest(ck, 1)
    return run


def test_export_refuses_non_finite_weights(run_dir, tmp_path, capsys):
    """NaN weights used to be exported without a word (and `wanka import` then refused them)."""
    name = "layers.1.moe.experts.w3"
    run = _diverged_copy(run_dir, tmp_path, name)
    err = one_line_error(capsys, ["export", str(run), "--out", str(tmp_path / "hf")],
                         f"holds NaN or Inf values in {name!r}")  # fmt: skip
    assert f"--checkpoint {run / 'checkpoints' / 'step-00000000'}" in err
    assert not (tmp_path / "hf").exists()
    step0 = str(run / "checkpoints" / "step-00000000")
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--checkpoint", step0]) == 0


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_weights_are_as_readable_as_config_json(run_dir, tmp_path, umask):
    """model.safetensors was 0600 (safetensors' save_file), config.json 0644."""
    old = os.umask(umask)
    try:
        assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    for name in EXPORT_FILES:
        assert (tmp_path / "hf" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_export_notes_few_index_heads(run_dir, tmp_path, capsys):
    from wanka.interop.cli import _few_index_heads_note

    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "n_index_heads is 2" in err and "index_topk 8" in err, err
    _few_index_heads_note(dataclasses.replace(CFG, n_index_heads=16))
    _few_index_heads_note(dataclasses.replace(CFG, index_topk=CFG.max_seq_len))  # dense
    assert capsys.readouterr().err == ""


# -- the tokenizer an import gets ------------------------------------------------------------


def _word_tokenizer(path, n: int) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(n - 1)} | {"[UNK]": n - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(path))


def test_import_refuses_a_tokenizer_larger_than_the_model(hf_dir, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    _word_tokenizer(src / "tokenizer.json", 300)
    one_line_error(capsys, ["import", str(src), "--out", str(tmp_path / "run")],
                   "has 300 tokens and the model's vocab_size is 256")  # fmt: skip
    (src / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    one_line_error(capsys, ["import", str(src), "--out", str(tmp_path / "run")],
                   "is not a readable tokenizer.json")  # fmt: skip
    _word_tokenizer(src / "tokenizer.json", 256)  # as many as the model: fine
    assert main(["import", str(src), "--out", str(tmp_path / "run")]) == 0
    assert _names(tmp_path) == ["run", "src"]


def _hf_vocab(tmp_path, vocab: int):
    """The tiny model with another vocab_size, exported with the byte tokenizer files."""
    from wanka.interop.cli import write_hf
    from wanka.models.transformer import Transformer

    cfg = dataclasses.replace(CFG, vocab_size=vocab)
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(0)
    out = tmp_path / f"hf{vocab}"
    out.mkdir()
    write_hf(m.state_dict(), cfg, "byte", out)
    return out


def test_import_without_tokenizer_needs_a_byte_level_vocab(hf_dir, tmp_path, capsys):
    """No tokenizer.json used to mean the byte tokenizer whatever the vocab_size."""
    from wanka.config.loader import load_config

    big = _hf_vocab(tmp_path, 512)
    # A byte run with its vocab rounded up (as training allows): its byte tokenizer.json says so.
    assert main(["import", str(big), "--out", str(tmp_path / "padded")]) == 0
    assert load_config(tmp_path / "padded" / "config.toml").data.tokenizer == "byte"
    (big / "tokenizer.json").unlink()
    (big / "tokenizer_config.json").unlink()
    one_line_error(capsys, ["import", str(big), "--out", str(tmp_path / "run")],
                   "has no tokenizer.json, and the byte tokenizer wanka would use fits "
                   "vocab_size 256 only (config.json's is 512)")  # fmt: skip
    assert not (tmp_path / "run").exists()
    small = tmp_path / "small"
    shutil.copytree(hf_dir, small)
    (small / "tokenizer.json").unlink()
    assert main(["import", str(small), "--out", str(tmp_path / "run")]) == 0  # 256: as before
    assert load_config(tmp_path / "run" / "config.toml").data.tokenizer == "byte"


# -- two commands, one --out -----------------------------------------------------------------


@pytest.fixture(scope="module")
def word_run(hf_dir, tmp_path_factory):
    """A run whose export differs from run_dir's (its tokenizer.json): who won shows."""
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("word")
    shutil.copytree(hf_dir, tmp / "hf")
    _word_tokenizer(tmp / "hf" / "tokenizer.json", 3)
    assert main(["import", str(tmp / "hf"), "--out", str(tmp / "run")]) == 0
    return tmp / "run"


def _another_export_midway(monkeypatch, argv: list[str]) -> list[int]:
    """Make the next export run `wanka ARGV` (to its end) after writing its own files and
    before moving them in: two exports of one --out at once. Returns [that one's exit]."""
    import wanka.interop.cli as icli

    write, codes = icli.write_hf, []

    def write_then_other(*args):
        done = write(*args)
        monkeypatch.setattr(icli, "write_hf", write)
        codes.append(main(argv))
        return done

    monkeypatch.setattr(icli, "write_hf", write_then_other)
    return codes


def test_two_exports_into_one_out(run_dir, word_run, tmp_path, monkeypatch, capsys):
    """The second export to start used to delete the first one's staging folder (a fixed
    name) mid-write, and both moved files into --out: a traceback and maybe a mix."""
    out = tmp_path / "hf"
    word = (word_run / "tokenizer.json").read_bytes()
    codes = _another_export_midway(monkeypatch, ["export", str(word_run), "--out", str(out)])
    # The other one finishes first and wins whole; this one, without --force, fails in one line
    # (after the other's own note on stderr).
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(out)]) == 2 and codes == [0]
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "changed while this command ran" in last, err
    assert "pass --force" in last
    assert _names(out) == EXPORT_FILES and (out / "tokenizer.json").read_bytes() == word
    # With --force the one to finish last replaces the other's files whole.
    codes = _another_export_midway(monkeypatch, ["export", str(word_run), "--out", str(out),
                                                 "--force"])  # fmt: skip
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0 and codes == [0]
    assert _names(out) == EXPORT_FILES and (out / "tokenizer.json").read_bytes() != word
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"  # byte


def test_stale_staging_folders_go_and_live_ones_stay(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    for name in (".wanka-partial", ".wanka-partial-999999-0123abcd", ".wanka-partial-1-89abcdef"):
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"half")
    live = out / ".wanka-partial-1-89abcdef"  # held by a running command (here: this test)
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Staging folders are not --out's content: no --force needed, and none is replaced.
        assert main(["export", str(run_dir), "--out", str(out)]) == 0
        assert _names(out) == [live.name, *EXPORT_FILES]
        assert (live / "model.safetensors").read_bytes() == b"half"
    finally:
        os.close(fd)
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0
    assert _names(out) == EXPORT_FILES  # its command gone: leftovers
