"""`wanka export` / `wanka import` on bad input: one line, exit 2, nothing lost or half-written.

A tiny MLA model is written as a Hugging Face directory (write_hf), imported into a run
directory (model-only checkpoint, no training), and both are then damaged on purpose."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from wanka.cli import main

from .tiny_hf import write_tiny_hf


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


def _copy(src, tmp_path, name="bad"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_imported_run_has_a_loadable_config(run_dir):
    """max_position_embeddings 64 < the default data.seq_len 256: the run directory written
    used to fail `load_config` (data.seq_len > model.max_seq_len)."""
    from wanka.config.loader import load_config

    assert load_config(run_dir / "config.toml").data.seq_len == 64


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: (d / "config.json").write_text('{"model_type": "deepseek_v32",'), "not readable JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    (lambda d: _edit_config(d, hidden_size="32"), "config.json's hidden_size"),
    (lambda d: _edit_config(d, q_lora_rank=None), "config.json's q_lora_rank"),
    (lambda d: _edit_config(d, num_hidden_layers=-1), "config.json's num_hidden_layers"),
    (lambda d: _edit_config(d, hidden_size=48), "has shape [256, 32], the config implies [256, 48]"),
    (lambda d: _edit_config(d, num_nextn_predict_layers=2), "model.layers.3.input_layernorm.weight' is missing"),
    (lambda d: _edit_config(d, n_routed_experts=8), "experts.4.gate_proj.weight' is missing"),
    (lambda d: _edit_config(d, tie_word_embeddings=False), "'lm_head.weight' is missing"),
    (lambda d: _edit_config(d, num_nextn_predict_layers=0), "is not part of the model"),
    (lambda d: (d / "model.safetensors").write_bytes(b""), "not a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "not a readable safetensors file"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"nope": 1}'), "not a safetensors index"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"x": "model-00002-of-00002.safetensors"}}'), "lacks model-00002-of-00002"),
])  # fmt: skip
def test_bad_hf_directory_is_one_line(hf_dir, tmp_path, capsys, damage, fragment):
    bad = _copy(hf_dir, tmp_path)
    damage(bad)
    one_line_error(capsys, ["import", str(bad), "--out", str(tmp_path / "out")], fragment)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_quantized_weights_are_refused(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = _copy(hf_dir, tmp_path)
    t = load_file(str(bad / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)
    save_file(t, str(bad / "model.safetensors"))
    one_line_error(capsys, ["import", str(bad), "--out", str(tmp_path / "o")], "dequantize")


def test_export_never_replaces_its_own_run_or_foreign_files(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path, "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for out in (run, tmp_path):  # the run itself, a folder holding it
        one_line_error(capsys, ["export", str(run), "--out", str(out), "--force"], "which this "
                       "command reads")  # fmt: skip
    # Inside the run: --force replaces an earlier export only, never the checkpoints.
    one_line_error(capsys, ["export", str(run), "--out", str(run / "checkpoints"), "--force"],
                   "replaces an earlier export only")  # fmt: skip
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    one_line_error(capsys, ["export", str(run), "--out", str(mine), "--force"], "'notes.txt'")
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("x")
    one_line_error(capsys, ["export", str(run), "--out", str(tmp_path / "afile")], "is a file")


def test_export_force_replaces_an_earlier_export(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging folder left behind


def test_export_into_the_current_directory(run_dir, tmp_path, monkeypatch, capsys):
    # `--out .` in an empty folder: the files land there (staging inside it, then renamed),
    # and a second export with --force replaces them.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for extra in ([], ["--force"]):
        assert main(["export", str(run_dir), "--out", ".", *extra]) == 0
        assert sorted(p.name for p in here.iterdir()) == ["config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]  # fmt: skip


def test_import_never_replaces_its_source_or_foreign_files(hf_dir, run_dir, tmp_path, capsys):
    src = _copy(hf_dir, tmp_path, "src")
    one_line_error(capsys, ["import", str(src), "--out", str(src), "--force"], "which this command")
    assert (src / "model.safetensors").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_text("x")
    one_line_error(capsys, ["import", str(src), "--out", str(other), "--force"], "no config.toml")
    assert (other / "data.bin").is_file()
    # A run directory is replaced with --force (and only then).
    run = _copy(run_dir, tmp_path, "run")
    one_line_error(capsys, ["import", str(src), "--out", str(run)], "--force")
    assert main(["import", str(src), "--out", str(run), "--force"]) == 0
    assert (run / "config.toml").is_file()
