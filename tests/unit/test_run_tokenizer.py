"""A run's tokenizer is the one it trained with: RUN_DIR/tokenizer.json, kept at train time and
checked against the data's tokenizer, read before the file its config names."""

import json
from pathlib import Path

from wanka.data.tokenizer import _content_name, keep_run_tokenizer
from wanka.infer.load import run_tokenizer


def _tok(path: Path, words: str) -> Path:
    path.write_text(json.dumps({"model": words}))  # content only: nothing here parses it
    return path


def test_the_copy_is_the_data_tokenizer_and_wins_over_the_original(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    t1 = _tok(tmp_path / "t1.json", "one")
    keep_run_tokenizer(str(t1), run, _content_name(t1.read_bytes()))
    assert (run / "tokenizer.json").read_bytes() == t1.read_bytes()
    _tok(t1, "edited")  # the original edited in place after training
    assert run_tokenizer(run, str(t1)) == str(run / "tokenizer.json")
    t1.unlink()
    assert run_tokenizer(run, str(t1)) == str(run / "tokenizer.json")


def test_a_reused_run_dir_gets_the_new_runs_tokenizer(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    t1, t2 = _tok(tmp_path / "t1.json", "one"), _tok(tmp_path / "t2.json", "two")
    keep_run_tokenizer(str(t1), run, _content_name(t1.read_bytes()))
    keep_run_tokenizer(str(t2), run, _content_name(t2.read_bytes()))  # from scratch, other data
    assert (run / "tokenizer.json").read_bytes() == t2.read_bytes()
    keep_run_tokenizer("byte", run)  # and again, byte-level: no copy of another's
    assert not (run / "tokenizer.json").exists()


def test_a_file_edited_since_the_data_was_prepared_is_not_kept(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    t1 = _tok(tmp_path / "t1.json", "one")
    prepared_with = _content_name(t1.read_bytes())
    keep_run_tokenizer(str(t1), run, prepared_with)
    _tok(t1, "edited")
    keep_run_tokenizer(str(t1), run, prepared_with)  # a resume: the good copy stays
    assert _content_name((run / "tokenizer.json").read_bytes()) == prepared_with
    other = tmp_path / "other"
    other.mkdir()
    keep_run_tokenizer(str(t1), other, prepared_with)  # never copied under the data's name
    assert not (other / "tokenizer.json").exists()
