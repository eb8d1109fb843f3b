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


def _drop_config_keys(d, *keys):
    cfg = json.loads((d / "config.json").read_text())
    for k in keys:
        del cfg[k]
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"))


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
    (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act is 'gelu'"),
    (lambda d: _edit_config(d, mlp_layer_types=["sparse", "dense"]), "mlp_layer_types"),
    (lambda d: _edit_config(d, mlp_layer_types=["dense"]), "names 1 layers"),
    (lambda d: _drop_config_keys(d, "n_group"), "lacks n_group, and transformers' default for it (8)"),
    (lambda d: _drop_config_keys(d, "hidden_size"), "config.json lacks hidden_size:"),
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
    one_line_error(capsys, ["import", str(src), "--out", str(other), "--force"], "'data.bin'")
    assert (other / "data.bin").is_file()
    (other / "data.bin").unlink()
    (other / "checkpoints").mkdir()
    one_line_error(capsys, ["import", str(src), "--out", str(other), "--force"], "no config.toml")
    # A run directory is replaced with --force (and only then).
    run = _copy(run_dir, tmp_path, "run")
    one_line_error(capsys, ["import", str(src), "--out", str(run)], "--force")
    assert main(["import", str(src), "--out", str(run), "--force"]) == 0
    assert (run / "config.toml").is_file()


def _snapshot(root):
    """Every path under root with its bytes (None for a folder): equal means untouched."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}  # fmt: skip


def test_import_force_never_deletes_a_project_with_a_config_toml(hf_dir, tmp_path, capsys):
    """A project folder that happens to hold a config.toml is not a run directory: --force
    used to delete .git/, src/ and README.md along with it."""
    proj = tmp_path / "proj"
    (proj / ".git").mkdir(parents=True)
    (proj / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (proj / "src").mkdir()
    (proj / "src" / "main.py").write_text("print('hi')\n")
    (proj / "README.md").write_text("# my project\n")
    (proj / "config.toml").write_text('[model]\nflavor = "tiny"\n')
    before = _snapshot(proj)
    err = one_line_error(capsys, ["import", str(hf_dir), "--out", str(proj), "--force"], "'.git'")
    assert "wanka does not write" in err
    assert _snapshot(proj) == before
    # Only wanka's own entries, but a config.toml that is not wanka's: refused too.
    shutil.rmtree(proj / ".git")
    shutil.rmtree(proj / "src")
    (proj / "README.md").unlink()
    (proj / "config.toml").write_text("[tool.ruff]\nline-length = 100\n")
    (proj / "logs").mkdir()
    before = _snapshot(proj)
    one_line_error(capsys, ["import", str(hf_dir), "--out", str(proj), "--force"],
                   "config.toml is not a wanka config")  # fmt: skip
    assert _snapshot(proj) == before


def test_import_force_replaces_a_trained_run_directory(hf_dir, run_dir, tmp_path, capsys):
    """What training, reports and the supervisor leave in a run directory is all replaced."""
    run = _copy(run_dir, tmp_path, "run")
    for d in ("logs", "resilience", "tb"):
        (run / d).mkdir()
        (run / d / "x").write_text("x")
    for f in ("metrics.jsonl", "summary.json", "loss_curve.png", "timeline.png", "post_command"):
        (run / f).write_text("x")
    assert main(["import", str(hf_dir), "--out", str(run), "--force"]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.toml"]


def test_missing_keys_take_transformers_defaults(hf_dir, tmp_path, capsys):
    """save_pretrained-style config.json without routed_scaling_factor: transformers runs it
    with 2.5; the import used to build the model with 1.0."""
    from wanka.config.loader import load_config

    src = _copy(hf_dir, tmp_path, "src")
    _edit_config(src, routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse"])
    _drop_config_keys(src, "routed_scaling_factor", "first_k_dense_replace", "index_topk")
    assert main(["import", str(src), "--out", str(tmp_path / "run")]) == 0
    m = load_config(tmp_path / "run" / "config.toml").model
    assert (m.route_scale, m.n_dense_layers, m.index_topk) == (2.5, 1, 2048)


def test_defaults_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    from wanka.interop.hf import _DEFAULTS

    theirs = transformers.DeepseekV32Config()
    for key, value in _DEFAULTS.items():
        if key != "num_nextn_predict_layers":  # not a transformers key: it runs no MTP
            assert getattr(theirs, key) == value, key
    assert theirs.hidden_act == "silu" and theirs.norm_topk_prob


def test_tied_config_with_a_different_lm_head_is_refused(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path)

    def add_head(t, scale):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] * scale

    _edit_tensors(bad, lambda t: add_head(t, 2.0))
    one_line_error(capsys, ["import", str(bad), "--out", str(tmp_path / "o")],
                   "lm_head.weight differs from model.embed_tokens.weight")  # fmt: skip
    assert not (tmp_path / "o").exists()
    _edit_tensors(bad, lambda t: add_head(t, 1.0))  # the copy some writers keep: fine
    assert main(["import", str(bad), "--out", str(tmp_path / "o")]) == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(hf_dir, tmp_path, capsys, value):
    bad = _copy(hf_dir, tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit_tensors(bad, lambda t: t[name].view(-1).__setitem__(7, value))
    one_line_error(capsys, ["import", str(bad), "--out", str(tmp_path / "o")],
                   f"tensor {name!r} holds NaN or Inf")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_weights_without_their_mtp_layer_import_without_mtp(hf_dir, tmp_path, capsys):
    """transformers' save_pretrained drops the MTP layer and keeps num_nextn_predict_layers."""
    from wanka.config.loader import load_config

    src = _copy(hf_dir, tmp_path, "src")
    mtp = "model.layers.2."

    def drop(t, keep: set):
        for k in [k for k in t if k.startswith(mtp) and k not in keep]:
            del t[k]

    _edit_tensors(src, lambda t: drop(t, keep={mtp + "enorm.weight"}))
    one_line_error(capsys, ["import", str(src), "--out", str(tmp_path / "o")],
                   "'model.layers.2.input_layernorm.weight' is missing")  # a part: refused  # fmt: skip
    _edit_tensors(src, lambda t: drop(t, keep=set()))
    capsys.readouterr()
    assert main(["import", str(src), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "importing without MTP" in err, err
    assert load_config(tmp_path / "o" / "config.toml").model.mtp_depth == 0


def _word_tokenizer(path) -> None:
    """A tokenizer.json that is not the byte tokenizer: the import copies it into the run."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))


def test_export_of_a_run_whose_tokenizer_moved_is_one_line(hf_dir, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    src = _copy(hf_dir, tmp_path, "src")
    _word_tokenizer(src / "tokenizer.json")
    assert main(["import", str(src), "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json"
    ).read_bytes()
    # Moved, its config.toml names the old path: the run's own copy is found beside it.
    (tmp_path / "run").rename(tmp_path / "moved")
    assert main(["export", str(tmp_path / "moved"), "--out", str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json"
    ).read_bytes()
    assert (
        main(["generate", str(tmp_path / "moved"), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    )
    # Without the copy, one line naming the setting.
    (tmp_path / "moved" / "tokenizer.json").unlink()
    one_line_error(capsys, ["export", str(tmp_path / "moved"), "--out", str(tmp_path / "hf3")],
                   "data.tokenizer")  # fmt: skip
    assert not (tmp_path / "hf3").exists()
