"""`wanka generate` prints what the tokenizer makes of prompt + completion.

A completion decoded on its own loses its first space with SentencePiece-style tokenizers
(Metaspace, or Llama's Replace + Strip decoders strip the leading space of whatever they
decode): "Hello" + "▁world" printed as "Helloworld", streamed and in --json alike."""

from __future__ import annotations

import json
import shutil

import pytest

from wanka.cli import main

from .tiny_hf import write_tiny_hf

VOCAB = ["<unk>", "▁Hello", "▁world", "!", "▁", "a"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("meta")
    hf = write_tiny_hf(tmp / "hf")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    for f in hf.glob("tokenizer*.json"):
        f.unlink()
    tok.save(str(hf / "tokenizer.json"))
    assert main(["import", str(hf), "--out", str(tmp / "run")]) == 0
    shutil.rmtree(hf)
    return tmp / "run"


@pytest.fixture
def says_world(monkeypatch):
    """Every prompt is completed with "▁world", "!" (streamed as the decoder would)."""
    from wanka.infer import generate

    def fake(self, prompts, max_new_tokens, on_tokens=None):
        ids = [VOCAB.index("▁world"), VOCAB.index("!")]
        for t in ids:
            if on_tokens is not None:
                on_tokens(0, [t])
        return [list(ids) for _ in prompts]

    monkeypatch.setattr(generate.Generator, "generate", fake)


def test_a_completion_keeps_its_leading_space(run_dir, says_world, tmp_path, capsys):
    run = str(run_dir)
    capsys.readouterr()
    assert main(["generate", run, "--prompt", "Hello", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out == "Hello world!\n"  # streamed
    assert main(["generate", run, "--prompt", "Hello", "--max-new-tokens", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["prompt"] + row["completion"] == "Hello world!"
    f = tmp_path / "p.txt"
    f.write_text("Hello\nHello\n")
    assert main(["generate", run, "--prompts", str(f), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out == "Hello world!\n---\n" * 2
