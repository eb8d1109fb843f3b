"""Own data as a hostile newcomer brings it: odd file names, links, full disks, mixed folders."""

import errno
import os
from pathlib import Path

import pytest

from wanka.data.loader import PackedLoader
from wanka.data.prepare import TokenDataset, main_prepare, read_meta


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_file_name_that_is_not_utf8_is_prepared(tmp_path, capsys):
    """A Latin-1 file name (an old archive unpacked) failed with "'utf-8' codec can't encode
    character '\\udce9' ... surrogates not allowed", naming no file: the split hashes the name."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.txt").write_text("other file " * 100)
    with open(os.path.join(os.fsencode(docs), b"caf\xe9.txt"), "w") as f:
        f.write("latin-1 named file " * 100)
    assert main_prepare([str(docs)], str(tmp_path / "ds"), None, 0.5, 0) == 0, capsys.readouterr()
    s = read_meta(tmp_path / "ds")["splits"]
    assert s["train"]["num_docs"] + s["val"]["num_docs"] == 2


def test_not_utf8_names_the_true_offset_and_line(tmp_path, capsys):
    """The offset was relative to the decoder's buffer: 5325 for a bad byte of a .jsonl at
    byte 120,013 (line 5001), and 3 bytes short after a byte-order mark."""
    good = b'{"text": "hello world"}\n' * 5000
    (tmp_path / "a.jsonl").write_bytes(good + b'{"text": "caf\xe9"}\n')
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfabc\xe9")
    assert main_prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o"), None, 0.1, 0) == 2
    err = _err(capsys)
    assert f"byte 0xe9 at offset {len(good) + 13}, line 5001" in err and "iconv" in err, err
    assert main_prepare([str(tmp_path / "b.txt")], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "byte 0xe9 at offset 6, line 1" in _err(capsys)
    (tmp_path / "c.jsonl").write_bytes("hi".encode("utf-16"))  # UTF-16 still named as such
    assert main_prepare([str(tmp_path / "c.jsonl")], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "is UTF-16 text" in _err(capsys)


def test_link_loops_devices_and_pipes_are_named_not_a_traceback(tmp_path, capsys):
    """A file link loop given as an input raised RuntimeError("Symlink loop") as a bare
    traceback; in a folder it was "a link to b.txt, which does not exist" (b.txt exists); a
    link to /dev/zero or a pipe was "input not found"."""
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "a.txt").symlink_to("b.txt")
    (loop / "b.txt").symlink_to("a.txt")
    assert main_prepare([str(loop / "a.txt")], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "a.txt is a link loop" in _err(capsys)
    assert main_prepare([str(loop)], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "a.txt is a link loop" in _err(capsys)
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.txt")
    for name in ("zero.txt", "fifo.txt"):
        assert main_prepare([str(tmp_path / name)], str(tmp_path / "o"), None, 0.1, 0) == 2
        assert f"{name} is not a regular file" in _err(capsys)
    assert main_prepare([str(tmp_path / "gone.txt")], str(tmp_path / "o"), None, 0.1, 0) == 2
    assert "input not found" in _err(capsys)


def test_a_full_disk_names_out_and_the_fix(tmp_path, capsys, monkeypatch):
    """A write that fails for space carries no file name: it printed only "[Errno 28] No space
    left on device"."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"doc {i} " * 200)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert main_prepare([str(docs)], str(tmp_path / "ds"), None, 0.1, 0) == 2
    err = _err(capsys)
    assert "cannot write the dataset at" in err and "free space" in err, err
    assert not (tmp_path / "ds").exists() and [p.name for p in tmp_path.iterdir()] == ["docs"]


def test_an_input_that_vanishes_while_read_says_run_again(tmp_path, capsys, monkeypatch):
    import wanka.data.prepare as prep

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"doc {i} " * 200)
    read = prep._read_documents

    def vanishing(f, name):
        (docs / "2.txt").unlink(missing_ok=True)
        return read(f, name)

    monkeypatch.setattr(prep, "_read_documents", vanishing)
    assert main_prepare([str(docs)], str(tmp_path / "ds"), None, 0.1, 0) == 2
    err = _err(capsys)
    assert "2.txt disappeared while being read" in err and "again" in err, err


def test_files_of_other_kinds_in_a_folder_are_reported_not_dropped_silently(tmp_path, capsys):
    """A folder of .txt and .txt.gz / .md / .parquet lost every file of the other kinds without
    a word (here 97% of the text)."""
    import gzip

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("alpha " * 3000)
    (docs / "b.txt").write_text("beta " * 3000)
    with gzip.open(docs / "c.txt.gz", "wt") as f:
        f.write("gamma " * 100000)
    (docs / "notes.md").write_text("markdown " * 100000)
    (docs / ".hidden.md").write_text("hidden files stay unmentioned")
    assert main_prepare([str(docs)], str(tmp_path / "ds"), None, 0.1, 0) == 0
    out = capsys.readouterr()
    assert "ds: prepared" in out.out
    assert "skipped 2 files" in out.err and "1 .gz, 1 .md" in out.err, out.err
    assert "--out" not in out.err and len(out.err.strip().splitlines()) == 1


def test_a_train_split_below_one_window_says_what_to_set(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("tiny doc\n")
    (tmp_path / "b.txt").write_text("tiny doc two\n")
    assert main_prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "ds"),
                        None, 0.1, 0) == 0  # fmt: skip
    train = TokenDataset(tmp_path / "ds", "train")
    with pytest.raises(ValueError, match=rf"lower data.seq_len to {train.num_tokens - 1} or less"):
        PackedLoader(train, 64, 1, 0, 1, 0)


def test_the_fix_for_a_data_path_inside_a_dataset_is_the_dataset(tmp_path, capsys):
    """data.path=ds/train.bin was told to `wanka data prepare ds/train.bin`, which fails."""
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "b.txt").write_text("more text " * 50)
    ds = tmp_path / "ds"
    assert main_prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(ds), None, 0.1,
                        0) == 0  # fmt: skip
    with pytest.raises(ValueError, match=f"set data.path={ds}") as e:
        read_meta(ds / "train.bin")
    assert "wanka data prepare" not in str(e.value)


def test_spaces_and_non_ascii_paths_work(tmp_path, capsys):
    d = tmp_path / "my docs" / "ünï"
    d.mkdir(parents=True)
    (d / "naïve café.txt").write_text("Unicode path text. " * 200)
    (d / "second doc.txt").write_text("more text " * 200)
    out = tmp_path / "out dir" / "dätä"
    assert main_prepare([str(tmp_path / "my docs")], str(out), None, 0.1, 0) == 0
    assert Path(out, "meta.json").is_file()


def test_an_out_below_a_file_says_a_file_is_in_the_way(tmp_path, capsys):
    """--out afile/sub printed "[Errno 17] File exists: 'afile'"."""
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "afile").write_text("not a folder")
    for out in ("afile/sub", "afile/sub/deeper"):
        assert main_prepare([str(tmp_path / "a.txt")], str(tmp_path / out), None, 0.1, 0) == 2
        err = _err(capsys)
        assert "a file is in the way" in err and "afile" in err and "choose another --out" in err


def test_inputs_that_are_all_empty_say_so(tmp_path, capsys):
    """Empty files gave "the train split is empty (all documents empty or in val)"."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n')
    inputs = [str(tmp_path / n) for n in ("a.txt", "b.txt", "c.jsonl")]
    assert main_prepare(inputs, str(tmp_path / "ds"), None, 0.1, 0) == 2
    assert "all 3 input documents are empty" in _err(capsys)


@pytest.mark.parametrize("fraction", [1.0, -0.1, float("nan")])
def test_a_bad_val_fraction_is_named_as_the_flag(tmp_path, capsys, fraction):
    (tmp_path / "a.txt").write_text("some text")
    assert main_prepare([str(tmp_path / "a.txt")], str(tmp_path / "o"), None, fraction, 0) == 2
    err = _err(capsys)
    assert "--val-fraction" in err and "out of range" in err
    assert not (tmp_path / "o").exists()
