"""Tokenize documents once into memory-mapped token shards that keep document boundaries.

A prepared dataset directory holds:
  meta.json    format version, tokenizer, vocab_size, dtype, per-split num_tokens/num_docs
  <split>.bin  flat token ids (uint8 / uint16 / uint32, the smallest that fits the vocab)
  <split>.idx  int64 document start offsets into <split>.bin, length num_docs + 1
for split in ("train", "val").
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from wanka.data.corpus import Document, builtin_documents, split_documents
from wanka.data.tokenizer import Tokenizer, load_tokenizer

FORMAT = "wanka-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DATASET_FILES = {"meta.json", *(f"{s}.{ext}" for s in SPLITS for ext in ("bin", "idx"))}
_ENCODE_CHUNK = 256  # documents per encode_batch call: parallel, yet bounded memory
# Held-out text the split keeps at least (a tenth of the corpus at most): enough for 16
# windows of 2048 bytes, so the default val fraction still evaluates a small corpus.
MIN_VAL_CHARS = 32768
NO_TARGETS = ("every train document is one token long, so there is nothing to predict (a token is "
              "predicted from earlier tokens of its own document): join the short texts into "
              "longer documents")  # fmt: skip


def token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def _fix_hint(path: Path) -> str:
    if path.is_file() and is_prepared(path.parent):  # data.path=ds/train.bin
        return f"set data.path={path.parent}, the dataset's folder, not a file in it"
    raw = path.is_dir() and (any(path.glob("*.txt")) or any(path.glob("*.jsonl")))
    if path.is_file() or raw:
        # data.path names the raw documents: never suggest preparing over them.
        out = path.with_name(path.stem + "-prepared")
        return (
            f"prepare them first: `wanka data prepare {path} --out {out}`, then set data.path={out}"
        )
    return f"run `wanka data prepare <inputs> --out {path}`"


def read_meta(path: str | Path) -> dict:
    """meta.json of a complete dataset dir; ValueError (one line) if missing or inconsistent."""
    path = Path(path)
    meta_file = path / "meta.json"
    try:
        if not meta_file.is_file():
            raise ValueError(f"no prepared dataset at {path} (missing meta.json); "
                             f"{_fix_hint(path)}")  # fmt: skip
        text = meta_file.read_text()
    except PermissionError as e:
        raise ValueError(f"the dataset at {path} cannot be read ({e.strerror}): make it "
                         "readable for this user, or use another dataset") from None  # fmt: skip
    try:
        meta = json.loads(text)
        if not isinstance(meta, dict):
            raise ValueError(f"meta.json holds a {type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"unsupported format {meta.get('format')} v{meta.get('version')}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            info = meta["splits"][split]
            for suffix, expected in (
                ("bin", info["num_tokens"] * itemsize),
                ("idx", (info["num_docs"] + 1) * 8),
            ):
                f = path / f"{split}.{suffix}"
                if not f.is_file() or f.stat().st_size != expected:
                    raise ValueError(f"{f.name} is missing or has the wrong size")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"corrupt dataset at {path}: {e}; delete it and {_fix_hint(path)}") from e
    return meta


def is_prepared(path: str | Path) -> bool:
    try:
        read_meta(path)
    except ValueError:
        return False
    return True


def _encode_all(docs: Sequence[Document], tokenizer: Tokenizer) -> Iterable[np.ndarray]:
    batch_encode = getattr(tokenizer, "encode_batch", None)
    if batch_encode is None:
        for d in docs:
            yield np.asarray(tokenizer.encode(d.text))
        return
    for i in range(0, len(docs), _ENCODE_CHUNK):
        yield from batch_encode([d.text for d in docs[i : i + _ENCODE_CHUNK]])


def _write_split(
    docs: Sequence[Document], tokenizer: Tokenizer, dtype: np.dtype, tmp: Path, split: str
) -> dict:
    offsets = [0]
    with open(tmp / f"{split}.bin", "wb") as f:
        for ids in _encode_all(docs, tokenizer):
            if len(ids) == 0:
                continue  # empty documents carry no tokens; drop them
            if int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0:
                raise ValueError(f"tokenizer {tokenizer.name} produced an id outside its vocab")
            f.write(np.asarray(ids, dtype=dtype).tobytes())
            offsets.append(offsets[-1] + len(ids))
        f.flush()
        os.fsync(f.fileno())
    np.asarray(offsets, dtype=np.int64).tofile(tmp / f"{split}.idx")
    return {"num_tokens": offsets[-1], "num_docs": len(offsets) - 1}


def prepare_documents(
    docs: Sequence[Document],
    out_dir: str | Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.01,
    seed: int = 0,
    sources: list | None = None,
    min_val_chars: int = MIN_VAL_CHARS,
    replace: bool = False,
) -> Path:
    """Tokenize ``docs`` into ``out_dir`` atomically; a complete existing ``out_dir`` is kept,
    or with ``replace`` swapped for the new build once that has succeeded.

    Everything is written into a temp dir beside ``out_dir`` and renamed into place, so
    concurrent preparers (e.g. every rank of a job) never observe a half-written dataset.
    """
    out_dir = Path(out_dir)
    if replace and is_prepared(out_dir):
        if others := sorted(p.name for p in out_dir.iterdir() if p.name not in DATASET_FILES):
            raise ValueError(f"--out {out_dir} also holds {', '.join(others[:3])}, which a "
                             "rebuild would delete: move them out of it, or choose another --out")  # fmt: skip
    elif out_dir.exists():
        if is_prepared(out_dir):
            _check_tokenizer(out_dir, tokenizer)
            return out_dir
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise ValueError(
                f"{out_dir} exists but is not a complete prepared dataset; "
                "delete it or choose another output dir"
            )
    if not docs:
        raise ValueError("no documents to prepare")
    if not any(d.text for d in docs):
        raise ValueError(f"all {len(docs)} input documents are empty: there is no text to "
                         "prepare; give files that hold text")  # fmt: skip
    train, val = split_documents(list(docs), val_fraction, seed, min_val_chars)
    dtype = token_dtype(tokenizer.vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        splits = {
            "train": _write_split(train, tokenizer, dtype, tmp, "train"),
            "val": _write_split(val, tokenizer, dtype, tmp, "val"),
        }
        if splits["train"]["num_tokens"] == 0:
            raise ValueError("the train split is empty (all documents empty or in val)")
        if splits["train"]["num_tokens"] <= splits["train"]["num_docs"]:
            raise ValueError(NO_TARGETS)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": {"name": tokenizer.name, "spec": getattr(tokenizer, "spec", None)},
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            "seed": seed,
            "sources": sources,
            "splits": splits,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _share_with_group(tmp)
        if replace and out_dir.exists():  # the old dataset goes only once the new one is built
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / out_dir.name)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                os.rename(old / out_dir.name, out_dir)  # the old dataset back where it was
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out_dir)  # atomic; also replaces an empty out_dir
            except OSError:
                if not is_prepared(out_dir):  # lost a race to an identical preparer: fine
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return out_dir


def _share_with_group(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: open it (and its files) as far as the umask allows, so a
    dataset or cache prepared by one user can be read by the group."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _check_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    prepared = read_meta(path)["tokenizer"]["name"]
    if prepared != tokenizer.name:
        raise ValueError(
            f"{path} was prepared with tokenizer {prepared}, not {tokenizer.name}; "
            "delete it or choose another output dir"
        )


def read_input_files(paths: Sequence[str | Path]) -> list[Document]:
    """``.txt``: one document per file; ``.jsonl``: one document per line (field "text").

    A directory stands for the ``.txt`` and ``.jsonl`` files below it, in sorted order, but
    not those under hidden folders (.git, .venv) or hidden themselves. A file named twice (a
    folder and a file in it, or two spellings of one path) is read once.
    """
    # Each file with the name its documents go by (the train/val split hashes it): the path
    # below the folder given, or the file's own name, so the split does not depend on where
    # the corpus lives or how its path was typed (./data, data, /home/me/data).
    files: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = folder_files(p)
            if not found:
                raise ValueError(f"{p} holds no .txt or .jsonl files{_other_kinds(p)}: wanka "
                                 "reads .txt (a document per file) and .jsonl ({\"text\": ...} "
                                 "per line)")  # fmt: skip
            files += [(f, f.relative_to(p).as_posix()) for f in found]
        elif not p.is_file():
            raise _not_a_file(p)
        elif p.suffix.lower() not in (".txt", ".jsonl"):
            raise ValueError(f"unsupported input {p}: expected .txt or .jsonl")
        else:
            files.append((p, p.name))
    seen: set[Path] = set()
    files = [(f, n) for f, n in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    docs = []
    for f, name in files:
        try:
            docs += _read_documents(f, name)
        except UnicodeDecodeError:
            raise _not_utf8(f) from None
    return docs


def _not_utf8(f: Path) -> ValueError:
    """The error for a file that does not decode, at its first bad byte. The decoder's own
    position is relative to its buffer (a .jsonl is read in chunks; a byte-order mark is cut
    off first): read again line by line, which a UTF-8 character never spans."""
    offset = 0
    with open(f, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                if offset == 0 and line[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's mark
                    return ValueError(f"{f} is UTF-16 text: convert it, e.g. `iconv -f UTF-16 "
                                      "-t UTF-8`, or leave it out")  # fmt: skip
                return ValueError(f"{f} is not UTF-8 text (byte {line[e.start]:#04x} at offset "
                                  f"{offset + e.start}, line {lineno}): convert it, e.g. `iconv "
                                  "-f LATIN1 -t UTF-8`, or leave it out")  # fmt: skip
            offset += len(line)
    return ValueError(f"{f} changed while being read: run the command again once it is written")


def _visible_files(folder: Path) -> list[Path]:
    """Every file below a folder, hidden files and folders left out, symlinked folders
    followed (a corpus assembled from links must not lose its linked parts silently), each
    real folder once (a link back up is not a loop)."""

    def unreadable(e: OSError) -> None:
        raise ValueError(f"cannot list {e.filename} ({e.strerror}): make it readable, or move "
                         "it out of the data folder") from None  # fmt: skip

    seen: set[tuple[int, int]] = set()
    out: list[Path] = []
    for top, dirs, files in os.walk(folder, onerror=unreadable, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(top) / f for f in files if not f.startswith(".")]
    return [f for f in out if f.is_file() or (f.is_symlink() and not f.exists())]


def folder_files(folder: Path) -> list[Path]:
    """The .txt and .jsonl files below a folder, sorted; hidden files and folders left out."""
    found = sorted(f for f in _visible_files(folder) if f.suffix.lower() in (".txt", ".jsonl"))
    for f in found:
        if not f.exists():
            raise _not_a_file(f)
    return found


def _not_a_file(p: Path) -> ValueError:
    """Why an input is not a file to read: missing, a dangling link, a link loop, or a device,
    pipe or socket (reading /dev/zero or a pipe would never end)."""
    if p.is_symlink():
        try:
            p.stat()
        except OSError as e:
            what = (
                "a link loop" if e.errno == errno.ELOOP else "a link to a path that does not exist"
            )
            return ValueError(f"{p} is {what} ({p} -> {os.readlink(p)}): fix or remove the link")
    if os.path.exists(p):
        return ValueError(f"{p} is not a regular file (a device, pipe or socket): give .txt or "
                          ".jsonl files, or leave it out")  # fmt: skip
    return ValueError(f"input not found: {p}")


def _skipped_kinds(inputs: Sequence[str]) -> Counter:
    """The suffixes of the visible files in folder inputs that are not read."""
    return Counter(
        f.suffix.lower() or "no suffix"
        for p in map(Path, inputs)
        if p.is_dir()
        for f in _visible_files(p)
        if f.suffix.lower() not in (".txt", ".jsonl")
    )


def _other_kinds(folder: Path) -> str:
    """' (it holds 3 .md, 1 .json)': the file kinds a folder holds instead."""
    kinds = Counter(f.suffix.lower() or "no suffix" for f in _visible_files(folder))
    if not kinds:
        return " (it is empty)"
    return " (it holds " + ", ".join(f"{n} {k}" for k, n in kinds.most_common(4)) + ")"


def input_sources(paths: Sequence[str]) -> list:
    """What a prepared dataset was made from: each input file's path, size and mtime (and
    "builtin"), so preparing into an existing --out from other inputs is noticed."""
    out: list = []
    for p in map(Path, paths):
        if str(p) == "builtin":
            out.append("builtin")
            continue
        for f in folder_files(p) if p.is_dir() else [p]:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _read_documents(f: Path, name: str) -> list[Document]:
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the text.
    if f.suffix.lower() == ".txt":
        text = f.read_text(encoding="utf-8-sig")
        if "\x00" in text:  # UTF-16 without a byte-order mark reads as ASCII and NULs
            raise ValueError(f"{f} holds NUL bytes (at character {text.index(chr(0))}): if it is "
                             "UTF-16, convert it (`iconv -f UTF-16LE -t UTF-8`); if it is not "
                             "text, leave it out")  # fmt: skip
        return [Document(name, text)]
    docs = []
    with open(f, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["text"]
                if not isinstance(text, str):
                    raise TypeError("'text' is not a string")
            except KeyError:
                keys = ", ".join(map(str, list(row)[:6])) or "no fields"
                raise ValueError(f'{f}:{lineno}: expected a JSON object with a string "text" '
                                 f"field; this one has {keys}: rename the field holding the "
                                 "document to text") from None  # fmt: skip
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(
                    f'{f}:{lineno}: expected a JSON object with a string "text" field ({e})'
                ) from None
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's "\udc80": valid JSON, not valid Unicode
                raise ValueError(f"{f}:{lineno}: the \"text\" holds an unpaired surrogate "
                                 f"({text[e.start]!r} at character {e.start}), which is not "
                                 "Unicode: fix the program that wrote it, or drop the line") from None  # fmt: skip
            docs.append(Document(f"{name}:{lineno}", text))
    return docs


def builtin_dataset_dir(cache_dir: str | Path, tokenizer: Tokenizer) -> Path:
    # The stdlib differs between Python versions, so the version is part of the key.
    v = sys.version_info
    return Path(cache_dir) / f"builtin-{tokenizer.name}-py{v.major}.{v.minor}.{v.micro}"


def ensure_builtin_dataset(cache_dir: str | Path, tokenizer_spec: str | None = None) -> Path:
    """Prepare the built-in corpus once under ``cache_dir``; later calls just return the path."""
    tokenizer = load_tokenizer(tokenizer_spec)
    path = builtin_dataset_dir(cache_dir, tokenizer)
    if is_prepared(path):
        return path
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror
        raise ValueError(f"data.cache_dir={str(cache_dir)!r} cannot be made a folder "
                         f"({why}): point it at a writable directory") from None  # fmt: skip
    try:
        return prepare_documents(builtin_documents(), path, tokenizer, val_fraction=0.01, seed=0)
    except OSError as e:  # the built-in corpus is prepared there on first use
        why = e.strerror or str(e)
        fix = ("free space there or point data.cache_dir at another disk"
               if e.errno in (errno.ENOSPC, errno.EDQUOT) else
               "make it writable, or point data.cache_dir at a writable directory")  # fmt: skip
        raise ValueError(f"data.cache_dir={str(cache_dir)!r}: the built-in corpus cannot be "
                         f"prepared there ({why}): {fix}") from None  # fmt: skip


def main_prepare(
    inputs: list[str],
    out: str,
    tokenizer: str | None,
    val_fraction: float,
    seed: int,
    force: bool = False,
) -> int:
    """``wanka data prepare``: inputs are .txt/.jsonl files, folders, or ``builtin``. Exit 2
    with one line on bad input; an existing --out made from other inputs or options is
    refused (or rebuilt with ``force``), never silently kept."""
    try:
        if not out.strip():
            raise ValueError("--out is empty: name the folder to write the dataset into")
        if not 0 <= val_fraction < 1:  # named as the flag, not as the library's argument
            raise ValueError(f"--val-fraction {val_fraction} is out of range: give a fraction "
                             "in [0, 1), e.g. 0.01")  # fmt: skip
        out_dir = Path(out)
        files = [i for i in inputs if i != "builtin"]
        for f in map(Path, files):
            if not (f.is_file() or f.is_dir()):
                raise _not_a_file(f)
        _check_out_is_not_an_input(out_dir, inputs)
        tok = load_tokenizer(tokenizer)
        sources = input_sources(inputs)
        existed = is_prepared(out_dir)
        if existed and (diff := _options_differ(out_dir, tok, val_fraction, seed, sources)):
            if not force:
                raise ValueError(f"{out_dir} was prepared with other {diff}: pass --force to "
                                 "rebuild it, or choose another --out")  # fmt: skip
            existed, replace = False, True
        else:
            replace = False
        t0 = time.perf_counter()
        if not existed:
            docs = builtin_documents() if "builtin" in inputs else []
            docs += read_input_files(files)
            prepare_documents(docs, out_dir, tok, val_fraction, seed, sources=sources,
                              replace=replace)  # fmt: skip
        s = read_meta(out_dir)["splits"]
    except (ValueError, ImportError) as e:
        print(f"wanka data prepare: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        at = Path(os.fsdecode(e.filename)).resolve() if e.filename else None
        dest = Path(out).resolve()
        # Only what this command writes: --out, or its staging folder beside it (an input
        # that happens to sit next to --out is an input's problem).
        ours = at is not None and (at == dest or dest in at.parents or (
            at.parent == dest.parent and at.name.startswith(f".{dest.name}.")))  # fmt: skip
        # A write that fails for space carries no file name; reading inputs never does that.
        ours = ours or (at is None and e.errno in (errno.ENOSPC, errno.EDQUOT))
        if at is not None and at in dest.parents and e.errno in (errno.EEXIST, errno.ENOTDIR):
            print(f"wanka data prepare: cannot make --out {out} a folder: a file is in the way "
                  f"({e.filename}): choose another --out", file=sys.stderr)  # fmt: skip
        elif ours:  # a read-only or full disk: "[Errno 30] ... '.dp.tmp-qqp6zlrj'" before
            print(f"wanka data prepare: cannot write the dataset at {out} ({e.strerror}): "
                  "choose another --out, or free space there", file=sys.stderr)  # fmt: skip
        elif e.errno == errno.ENOENT and e.filename:  # listed, then gone before it was read
            print(f"wanka data prepare: input {e.filename} disappeared while being read: run "
                  "the command again once the inputs stop changing", file=sys.stderr)  # fmt: skip
        else:
            print(f"wanka data prepare: {e}", file=sys.stderr)
        return 2
    status = "already prepared, kept" if existed else f"prepared in {time.perf_counter() - t0:.1f}s"
    print(
        f"{out_dir}: {status}; tokenizer {tok.name}; "
        f"train {s['train']['num_docs']} docs {s['train']['num_tokens']:,} tokens; "
        f"val {s['val']['num_docs']} docs {s['val']['num_tokens']:,} tokens"
    )
    if not existed and (skipped := _skipped_kinds(files)):
        n = sum(skipped.values())
        kinds = ", ".join(f"{c} {k}" for k, c in skipped.most_common(4))
        print(f"{out_dir}: skipped {n} file{'s' * (n > 1)} of other kinds in the input folders "
              f"({kinds}): wanka reads only .txt and .jsonl; convert them (e.g. gunzip) to "
              "include them", file=sys.stderr)  # fmt: skip
    if s["val"]["num_docs"] == 0:  # prepared as asked, but `wanka train` will refuse it
        print(f"{out_dir}: no validation documents: `wanka train` needs some; whole documents "
              "are held out, so give 2 or more (and --val-fraction above 0)", file=sys.stderr)  # fmt: skip
    return 0


def _check_out_is_not_an_input(out_dir: Path, inputs: list[str]) -> None:
    out = out_dir.resolve()
    for i in inputs:
        p = Path(i).resolve()
        if i != "builtin" and (out == p or out in p.parents or (p.is_dir() and p in out.parents)):
            raise ValueError(f"--out {out_dir} overlaps the input {i}: choose an --out "
                             "outside the inputs (e.g. data/mine)")  # fmt: skip


def _options_differ(
    path: Path, tok: Tokenizer, val_fraction: float, seed: int, sources: list
) -> str:
    """Which of the saved options differ from these ('' if none). A dataset from before
    sources were recorded is compared on what it recorded."""
    meta = read_meta(path)
    diff = []
    if meta["tokenizer"]["name"] != tok.name:
        diff.append(f"tokenizer ({meta['tokenizer']['name']}, now {tok.name})")
    if meta.get("val_fraction") != val_fraction:
        diff.append(f"--val-fraction ({meta.get('val_fraction')}, now {val_fraction})")
    if meta.get("seed") != seed:
        diff.append(f"--seed ({meta.get('seed')}, now {seed})")
    if meta.get("sources") is not None and meta["sources"] != sources:
        diff.append("inputs (files added, removed or changed)")
    return "; ".join(diff)


class TokenDataset:
    """One split of a prepared dataset, memory-mapped read-only."""

    def __init__(self, path: str | Path, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        self.path = Path(path)
        self.split = split
        self.meta = read_meta(self.path)
        info = self.meta["splits"][split]
        self.vocab_size: int = self.meta["vocab_size"]
        self.num_tokens: int = info["num_tokens"]
        self.num_docs: int = info["num_docs"]
        dtype = np.dtype(self.meta["dtype"])
        # np.memmap refuses empty files (an empty val split is legal).
        self.tokens = (
            np.memmap(self.path / f"{split}.bin", dtype=dtype, mode="r")
            if self.num_tokens
            else np.zeros(0, dtype)
        )
        self.offsets = np.fromfile(self.path / f"{split}.idx", dtype=np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens:
            raise ValueError(f"corrupt dataset at {path}: bad {split}.idx; {_fix_hint(self.path)}")

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc_bounds(self, i: int) -> tuple[int, int]:
        """[start, end) token offsets of document ``i`` in this split."""
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def doc_tokens(self, i: int) -> np.ndarray:
        start, end = self.doc_bounds(i)
        return self.tokens[start:end]
