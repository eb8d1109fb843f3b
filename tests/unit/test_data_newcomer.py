"""Own data as a newcomer meets it: small corpora, wrong files, changed options, shared dirs."""

import json
import os
import stat
from pathlib import Path

import pytest

from wanka.data.corpus import Document, split_documents
from wanka.data.loader import validation_batches
from wanka.data.prepare import TokenDataset, main_prepare, prepare_documents, read_meta
from wanka.data.tokenizer import ByteTokenizer


def _docs(tmp_path: Path, n: int = 30, size: int = 900) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"{i:03d}.txt").write_text(f"document {i} " + "lorem ipsum dolor " * (size // 18))
    return d


def test_small_corpus_gets_enough_validation_text_for_a_batch(tmp_path):
    docs = [Document(f"d{i}", "x" * 1000) for i in range(200)]  # 200 kB, 1% would be 2 docs
    train, val = split_documents(docs, 0.01, 0, min_val_chars=32768)
    assert sum(len(d.text) for d in val) >= 20000  # a tenth of the text at most
    assert len(train) + len(val) == 200
    assert split_documents(docs, 0.0, 0, min_val_chars=32768)[1] == []  # 0 still means none


@pytest.mark.parametrize("seed", range(6))
def test_one_big_document_is_not_held_out_whole(seed):
    # A book and a note: the split holds out the note, never the book (it took 99% of the text).
    for big in (21_600, 3_000_000):
        docs = [Document("book", "x" * big), Document("notes", "y" * 300)]
        train, val = split_documents(docs, 0.01, seed, min_val_chars=32768)
        assert [d.name for d in train] == ["book"] and [d.name for d in val] == ["notes"]
    # Drawn by hash or chosen to fill, val never holds more than half of the text.
    for sizes in ([10 ** (i % 4 + 2) for i in range(12)], [100000, 100000, 100, 1000, 100]):
        docs = [Document(f"d{i}", "z" * n) for i, n in enumerate(sizes)]
        for fraction in (0.01, 0.3, 0.9):
            train, val = split_documents(docs, fraction, seed, min_val_chars=32768)
            assert train and val and sum(len(d.text) for d in val) <= sum(sizes) / 2


def test_val_split_smaller_than_a_batch_is_read_round_robin(tmp_path):
    out = prepare_documents([Document("a", "a" * 400), Document("b", "b" * 60)], tmp_path / "ds",
                            ByteTokenizer(), val_fraction=0.5, min_val_chars=0)  # fmt: skip
    val = TokenDataset(out, "val")
    batches = validation_batches(val, 16, 8, 4, 0, 2)  # 2 ranks x 8 rows of 16 > the split
    assert len(batches) == 1 and batches[0].tokens.shape == (8, 16)


def test_prepare_errors_are_one_line_exit_2(tmp_path, capsys):
    bad_utf8 = tmp_path / "latin1.txt"
    bad_utf8.write_bytes("caf\xe9 au lait".encode("latin-1"))
    bad_tok = tmp_path / "tokenizer.json"
    bad_tok.write_text("{not json")
    docs = _docs(tmp_path)
    cases = [
        ([str(tmp_path / "missing.txt")], str(tmp_path / "o1"), None, "input not found"),
        ([str(bad_utf8)], str(tmp_path / "o2"), None, "latin1.txt is not UTF-8"),
        ([str(docs)], str(tmp_path / "o3"), str(bad_tok), "is not a Hugging Face tokenizer.json"),
        ([str(docs)], str(docs), None, "overlaps the input"),
        ([str(docs)], str(docs / "sub"), None, "overlaps the input"),
    ]
    for inputs, out, tok, needle in cases:
        assert main_prepare(inputs, out, tok, 0.1, 0) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (docs / "sub").exists()


def test_existing_out_with_other_options_is_refused_then_forced(tmp_path, capsys):
    docs, out = _docs(tmp_path), tmp_path / "ds"
    assert main_prepare([str(docs)], str(out), None, 0.1, 0) == 0
    assert main_prepare([str(docs)], str(out), None, 0.1, 0) == 0  # same: kept
    assert "already prepared, kept" in capsys.readouterr().out
    assert main_prepare([str(docs)], str(out), None, 0.2, 0) == 2
    assert "--val-fraction (0.1, now 0.2)" in capsys.readouterr().err
    (docs / "new.txt").write_text("a new document " * 50)
    assert main_prepare([str(docs)], str(out), None, 0.1, 0) == 2
    assert "inputs (files added, removed or changed)" in capsys.readouterr().err
    assert main_prepare([str(docs)], str(out), None, 0.1, 0, force=True) == 0
    assert read_meta(out)["splits"]["train"]["num_docs"] + read_meta(out)["splits"]["val"]["num_docs"] == 31  # fmt: skip


def test_force_never_loses_the_old_dataset_or_other_files(tmp_path, capsys):
    docs, out = _docs(tmp_path), tmp_path / "ds"
    assert main_prepare([str(docs)], str(out), None, 0.1, 0) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # A rebuild that fails keeps the old dataset as it was: on reading its inputs, or inside
    # the build (every train document one token long).
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    words = tmp_path / "words.jsonl"
    words.write_text('{"text": "a"}\n' * 50)
    for inputs, needle in (([docs, bad], "bad.jsonl:2"), ([words], "nothing to predict")):
        assert main_prepare(list(map(str, inputs)), str(out), None, 0.0, 0, force=True) == 2
        assert needle in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "docs", "ds", "words.jsonl"]
    # Files of the user's inside --out are never deleted by a rebuild: refused, named.
    (out / "raw").mkdir()
    (out / "raw" / "notes.txt").write_text("mine")
    assert main_prepare([str(docs)], str(out), None, 0.2, 0, force=True) == 2
    err = capsys.readouterr().err.strip()
    assert "also holds raw" in err and len(err.splitlines()) == 1
    assert (out / "raw" / "notes.txt").read_text() == "mine"
    (out / "raw" / "notes.txt").unlink()
    (out / "raw").rmdir()
    assert main_prepare([str(docs)], str(out), None, 0.2, 0, force=True) == 0
    assert read_meta(out)["val_fraction"] == 0.2


def test_prepared_dataset_is_readable_by_the_group(tmp_path):
    old = os.umask(0o022)
    try:
        out = prepare_documents([Document("a", "abc" * 100), Document("b", "de" * 100)],
                                tmp_path / "ds", ByteTokenizer(), 0.5)  # fmt: skip
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) & 0o050 == 0o050
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o040


def test_fix_hint_never_points_at_the_raw_input(tmp_path):
    raw = tmp_path / "mine.jsonl"
    raw.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError) as e:
        TokenDataset(raw, "train")
    assert f"--out {tmp_path / 'mine-prepared'}" in str(e.value)
    assert f"--out {raw} " not in str(e.value) and not str(e.value).endswith(f"--out {raw}`")


def test_jsonl_surrogates_bom_and_a_non_object_meta_are_one_line(tmp_path, capsys):
    surrogate = tmp_path / "s.jsonl"
    surrogate.write_text('{"text": "good"}\n{"text": "\\udc80 bad"}\n')
    assert main_prepare([str(surrogate)], str(tmp_path / "o1"), None, 0.1, 0) == 2
    err = capsys.readouterr().err.strip()
    assert "s.jsonl:2" in err and "unpaired surrogate" in err and len(err.splitlines()) == 1
    bom = tmp_path / "bom.jsonl"  # a byte-order mark, as Windows editors write: not text
    bom.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    txt = tmp_path / "bom.txt"
    txt.write_bytes("\ufeffplain".encode())
    assert main_prepare([str(bom), str(txt)], str(tmp_path / "o2"), None, 0.0, 0) == 0
    data = TokenDataset(tmp_path / "o2", "train")
    assert bytes(data.tokens.tolist()) == b"firstsecondplain"
    (tmp_path / "o2" / "meta.json").write_text("null")
    with pytest.raises(ValueError, match="meta.json holds a NoneType"):
        read_meta(tmp_path / "o2")


def test_one_token_documents_have_nothing_to_predict(tmp_path, capsys):
    words = tmp_path / "words.jsonl"
    words.write_text("".join('{"text": "a"}\n' for _ in range(2000)))
    assert main_prepare([str(words)], str(tmp_path / "o"), None, 0.1, 0) == 2
    err = capsys.readouterr().err.strip()
    assert "nothing to predict" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # One two-token document is enough to train on.
    words.write_text(words.read_text() + '{"text": "ab"}\n')
    assert main_prepare([str(words)], str(tmp_path / "o"), None, 0.0, 0) == 0


def test_symlinked_subfolders_are_read_and_a_loop_is_not_followed(tmp_path, capsys):
    """A corpus assembled from links (`ln -s /data/wiki corpus/wiki`) lost its linked parts
    without a word: rglob does not enter symlinked folders. They are read now, each real
    folder once (a link back up is no loop), and an unreadable folder is named."""
    docs = _docs(tmp_path, n=10)
    (tmp_path / "elsewhere").mkdir()
    elsewhere = _docs(tmp_path / "elsewhere", n=5)
    (docs / "linked").symlink_to(elsewhere, target_is_directory=True)
    (docs / "loop").symlink_to(docs, target_is_directory=True)
    os.mkfifo(docs / "pipe.txt")  # not a file: never opened (reading it would block)
    assert main_prepare([str(docs)], str(tmp_path / "o"), None, 0.1, 0) == 0
    s = read_meta(tmp_path / "o")["splits"]
    assert s["train"]["num_docs"] + s["val"]["num_docs"] == 15
    (docs / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    assert main_prepare([str(docs)], str(tmp_path / "o3"), None, 0.1, 0) == 2
    assert "dangling.txt is a link to" in capsys.readouterr().err
    if os.geteuid() == 0:  # root reads anything: the check below needs another user
        return
    locked = docs / "locked"
    locked.mkdir()
    (locked / "a.txt").write_text("text " * 100)
    locked.chmod(0)
    try:
        assert main_prepare([str(docs)], str(tmp_path / "o2"), None, 0.1, 0) == 2
    finally:
        locked.chmod(0o755)
    assert "cannot list" in capsys.readouterr().err


def test_folders_skip_hidden_files_and_read_a_file_once(tmp_path, capsys):
    docs = _docs(tmp_path, n=30)
    (docs / ".venv" / "lib").mkdir(parents=True)
    (docs / ".venv" / "lib" / "LICENSE.txt").write_text("not a document " * 100)
    (docs / ".hidden.txt").write_text("nor this " * 100)
    (docs / "UPPER.TXT").write_text("an upper-case suffix is a text file too " * 30)
    first = docs / "000.txt"
    inputs = [str(docs), str(first), str(first.resolve()), str(first)]
    assert main_prepare(inputs, str(tmp_path / "o"), None, 0.1, 0) == 0
    s = read_meta(tmp_path / "o")["splits"]
    assert s["train"]["num_docs"] + s["val"]["num_docs"] == 31  # 30 + UPPER.TXT, each once
    notes = tmp_path / "notes"
    notes.mkdir()
    for name in ("a.md", "b.md", "c.json"):
        (notes / name).write_text("# text")
    assert main_prepare([str(notes)], str(tmp_path / "o2"), None, 0.1, 0) == 2
    err = capsys.readouterr().err
    assert "holds no .txt or .jsonl files (it holds 2 .md, 1 .json)" in err


def test_the_split_does_not_depend_on_where_the_corpus_lives_or_how_it_is_typed(
    tmp_path, monkeypatch
):
    """Documents were named by their path as typed, and the train/val split hashes the name:
    `prepare data`, `prepare ./data` and the same folder on a colleague's machine held out
    different documents (validation losses not comparable). Names are now the path below the
    folder given (a file given alone: its own name)."""
    import shutil

    docs = _docs(tmp_path, n=40)
    (docs / "sub").mkdir()
    (docs / "sub" / "x.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 40}) + "\n"
                                                  for i in range(12)))  # fmt: skip
    other = tmp_path / "colleague" / "corpus"
    shutil.copytree(docs, other)
    monkeypatch.chdir(tmp_path)
    vals = []
    for i, path in enumerate(("docs", "./docs/", str(docs), str(other))):
        assert main_prepare([path], str(tmp_path / f"o{i}"), None, 0.2, 0) == 0
        ds = TokenDataset(tmp_path / f"o{i}", "val")
        vals.append([bytes(ds.doc_tokens(j)) for j in range(ds.num_docs)])
    assert vals[0] and all(v == vals[0] for v in vals), [len(v) for v in vals]


def test_a_run_records_the_tokenizer_its_data_was_prepared_with(tmp_path):
    """`data prepare --tokenizer tok.json` then `train --set data.path=...` saved
    data.tokenizer = "byte" in the run's config, which generate, export and post-training
    read: they decoded the ids as bytes. The data's tokenizer is adopted now; a different one
    named, or the data's file gone or changed, is one line."""
    import shutil

    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from wanka.config import JobConfig
    from wanka.data.prepare import prepare_documents
    from wanka.data.tokenizer import load_tokenizer
    from wanka.train.trainer import adopt_dataset_tokenizer

    def word_tokenizer(path: Path, words: list[str]) -> Path:
        hf = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
        path.mkdir(parents=True)
        hf.save(str(path / "tokenizer.json"))
        return path / "tokenizer.json"

    corpus = ["the cat sat on the mat", "a dog ate the bone", "the end"] * 4
    tok = word_tokenizer(tmp_path / "tok", corpus)
    docs = [Document(f"d{i}", t) for i, t in enumerate(corpus)]
    data = prepare_documents(docs, tmp_path / "ds", load_tokenizer(str(tok)), val_fraction=0.25)

    def cfg_for(tokenizer: str, path: Path = data) -> JobConfig:
        cfg = JobConfig()
        cfg.data.path, cfg.data.tokenizer = str(path), tokenizer
        return cfg

    cfg = cfg_for("byte")  # the default
    adopt_dataset_tokenizer(cfg)
    assert cfg.data.tokenizer == str(tok.resolve())
    copy = tmp_path / "copy" / "tokenizer.json"  # the same file elsewhere: kept as given
    copy.parent.mkdir()
    shutil.copy(tok, copy)
    cfg = cfg_for(str(copy))
    adopt_dataset_tokenizer(cfg)
    assert cfg.data.tokenizer == str(copy)
    other = word_tokenizer(tmp_path / "other", ["completely different words here"])
    with pytest.raises(ValueError, match="is not the tokenizer .* was prepared with"):
        adopt_dataset_tokenizer(cfg_for(str(other)))
    byte_data = prepare_documents(docs, tmp_path / "bytes", load_tokenizer(None), val_fraction=0.25)
    with pytest.raises(ValueError, match="is not the tokenizer"):
        adopt_dataset_tokenizer(cfg_for(str(copy), byte_data))
    # Training reads ids only: the data's tokenizer file changed or gone here (data copied
    # to a cluster without it) is recorded all the same, with a warning; never refused.
    tok.write_text(other.read_text())
    cfg = cfg_for("byte")
    adopt_dataset_tokenizer(cfg, warn=True)
    assert cfg.data.tokenizer == str(tok.resolve())
    tok.unlink()
    cfg = cfg_for("byte")
    adopt_dataset_tokenizer(cfg)
    assert cfg.data.tokenizer == str(tok.resolve())


def test_nul_bytes_a_wrong_field_name_and_a_too_small_corpus_say_what_to_do(tmp_path, capsys):
    """UTF-16 without a byte-order mark is ASCII plus NULs: it was prepared as text (NUL
    tokens in the data). A .jsonl with {"content": ...} did not say which fields it had. A
    corpus whose half is below one window was told to raise --val-fraction, which cannot
    help (validation holds at most half the text)."""
    docs = _docs(tmp_path, n=4)
    (docs / "utf16.txt").write_bytes("hello world".encode("utf-16-le"))
    assert main_prepare([str(docs)], str(tmp_path / "o"), None, 0.1, 0) == 2
    err = capsys.readouterr().err
    assert "utf16.txt holds NUL bytes" in err and "iconv" in err and len(err.splitlines()) == 1
    (docs / "utf16.txt").unlink()
    (docs / "rows.jsonl").write_text(json.dumps({"content": "x", "id": 3}) + "\n")
    assert main_prepare([str(docs)], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "this one has content, id" in capsys.readouterr().err
    (docs / "rows.jsonl").unlink()
    assert main_prepare([str(docs)], str(tmp_path / "o"), None, 0.5, 0) == 0
    total = sum(TokenDataset(tmp_path / "o", s).num_tokens for s in ("train", "val"))
    with pytest.raises(ValueError, match=f"lower data.seq_len below {total // 2}, or add text"):
        validation_batches(TokenDataset(tmp_path / "o", "val"), total // 2 + 10, 1, 1, 0, 1)


def test_an_out_on_a_read_only_disk_or_empty_is_one_line(tmp_path, capsys):
    import subprocess

    from wanka.resilience.chaos import small_filesystem, tmpfs_unavailable

    docs = _docs(tmp_path, n=4)
    assert main_prepare([str(docs)], "", None, 0.1, 0) == 2
    assert "--out is empty" in capsys.readouterr().err
    if tmpfs_unavailable() is not None:
        return
    with small_filesystem(tmp_path / "ro", 1) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        assert main_prepare([str(docs)], str(ro / "ds"), None, 0.1, 0) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot write the dataset at" in err and "Read-only" in err and ".tmp-" not in err, err


def test_an_unreadable_input_beside_out_is_named_as_the_input(tmp_path, capsys, monkeypatch):
    """An OSError on an input that sits next to --out was reported as "cannot write the
    dataset" (found in review): only --out and its staging folder are this command's writes."""
    import wanka.data.prepare as prep

    notes = tmp_path / "notes.txt"
    notes.write_text("some text " * 100)

    def unreadable(f, name):
        raise PermissionError(13, "Permission denied", str(f))

    monkeypatch.setattr(prep, "_read_documents", unreadable)
    assert main_prepare([str(notes)], str(tmp_path / "ds"), None, 0.1, 0) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "notes.txt" in err and "cannot write" not in err, err
