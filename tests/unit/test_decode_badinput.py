"""`wanka generate` on bad input: one line, exit 2, nothing printed before the error.

The run directory is a tiny MLA model imported from a Hugging Face export (a model-only
checkpoint, no training), then damaged on purpose."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from wanka.cli import main
from wanka.config.schema import ModelConfig
from wanka.infer.sampling import Sampling, probabilities
from wanka.models.transformer import Transformer

from .tiny_hf import imported_run, one_line_error


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return imported_run(tmp_path_factory.mktemp("gen"))


def test_non_finite_or_tiny_temperatures():
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            Sampling(temperature=t)
    # A tiny temperature is greedy, not a NaN distribution that torch.multinomial rejects.
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    p = probabilities(logits, Sampling(temperature=1e-45))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    p = probabilities(logits, Sampling(temperature=0.7, top_p=0.9))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-6


def test_bad_prompts_are_one_line(run_dir, tmp_path, capsys):
    run = str(run_dir)
    one_line_error(capsys, ["generate", run, "--prompt", ""], "--prompt is empty")
    f = tmp_path / "p.txt"
    f.write_bytes(b"fine\nab\xff\xfecd\n")
    one_line_error(capsys, ["generate", run, "--prompts", str(f)], "p.txt:2: not UTF-8")
    for bad in ('{"prompt": 5}', '{"prompt": null}', '{"prompt": ""}'):
        f.write_text(bad + "\n")
        one_line_error(capsys, ["generate", run, "--prompts", str(f)], "must be a non-empty string")
    # The second prompt is too long: refused before the first batch prints anything.
    f.write_text("a\n" + "y" * 100 + "\n")
    one_line_error(capsys, ["generate", run, "--prompts", str(f), "--batch-size", "1",
                            "--max-new-tokens", "2"], "prompt 2: prompt (100 tokens)")  # fmt: skip
    one_line_error(capsys, ["generate", run, "--prompt", "a", "--max-new-tokens", "95",
                            "--speculate", "10"], "+ speculate (10)")  # fmt: skip
    one_line_error(capsys, ["generate", run, "--prompt", "a", "--seed", str(10**23)],
                   "--seed 100000000000000000000000 is out of range")  # fmt: skip
    one_line_error(capsys, ["generate", run, "--prompt", "a", "--temperature", "nan"],
                   "temperature nan")  # fmt: skip


def test_checkpoint_of_another_model_shape_is_one_line(run_dir, tmp_path, capsys):
    """A config.toml whose model no longer fits the checkpoint: DCP raises a CheckpointException
    (a BaseException), which used to escape as a traceback."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("\ndim = 32\n", "\ndim = 48\n"))
    one_line_error(capsys, ["generate", str(run), "--prompt", "a"], "model.dim: saved 32, now 48")
    # Without the recorded [model] config (an older writer) the tensor mismatch is named.
    from wanka.infer.load import _load

    # A real (CPU) model, as `wanka generate` loads into: DCP reads into its tensors.
    m = Transformer(ModelConfig(**{**json.loads(_saved_model(run)), "dim": 48}))
    with pytest.raises(ValueError, match=r"does not fit the model in .*config\.toml"):
        _load(next((run / "checkpoints").iterdir()), {"model": m.state_dict()}, run)
    # ... and the same model at the saved shape loads (the error is the shape, not the path).
    ok = Transformer(ModelConfig(**json.loads(_saved_model(run))))
    _load(next((run / "checkpoints").iterdir()), {"model": ok.state_dict()}, run)


def _saved_model(run) -> str:
    from wanka.infer.load import _load

    ck = next((run / "checkpoints").iterdir())
    return _load(ck, {"train": {"model_config": ""}}, run)["train"]["model_config"]


def test_a_damaged_newest_checkpoint_is_skipped_and_said(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ck = run / "checkpoints" / "step-00000000"
    shutil.copytree(ck, run / "checkpoints" / "step-00000005")
    damaged = run / "checkpoints" / "step-00000005"
    for f in damaged.iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(b"")
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint step-00000005" in err and "step-00000000]" in err
    # Whose checkpoint (a distillation's teacher, say) and which one is used instead.
    assert f"[{run}: skipping" in err and f"[{run}: using step-00000000 instead]" in err


def test_a_checkpoint_named_as_its_folder_shows_it_and_speculation_past_the_end(
    run_dir, tmp_path, capsys
):
    """`--checkpoint step-00000000` (as `ls RUN/checkpoints` shows it) said "no readable
    manifest"; `--speculate 3000 --max-new-tokens 5` drafted 3000 tokens per round (6.7 s
    for a 5-token answer; refused past max_seq_len): drafts are capped at the tokens left."""
    run = str(run_dir)
    capsys.readouterr()
    assert main(["generate", run, "--prompt", "a", "--max-new-tokens", "2", "--checkpoint",
                 "step-00000000", "--json"]) == 0  # fmt: skip
    named = json.loads(capsys.readouterr().out.splitlines()[0])
    assert main(["generate", run, "--prompt", "a", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == named
    one_line_error(capsys, ["generate", run, "--prompt", "a", "--checkpoint", "step-00000099"],
                   "no such directory")  # fmt: skip
    assert main(["generate", run, "--prompt", "a", "--max-new-tokens", "5", "--speculate",
                 "3000", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out.splitlines()[0])["tokens"] == 5
