"""Tokenizers: a dependency-free byte tokenizer and a wrapper for Hugging Face tokenizer files."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    name: str  # short, filesystem-safe identifier (used in cache dir names)
    vocab_size: int

    def encode(self, text: str) -> np.ndarray | list[int]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, lossless, needs nothing installed."""

    name = "byte"
    spec = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        # A window can cut a multi-byte character in half; never fail on that.
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. ``tokenizer.json`` from a model repo)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ImportError(
                f"tokenizer {path} needs the 'tokenizers' package: pip install tokenizers"
            ) from e
        self.path = Path(path)
        self.spec = str(self.path.resolve())
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json ({e}); pass "
                             "the tokenizer.json of a model repo, or 'byte'") from None  # fmt: skip
        # Ids a model must hold: one past the largest (ids may have gaps, e.g. added special
        # tokens at the end of a reserved range), not just how many there are.
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1
        )
        # Content hash, so a changed file never reuses a stale prepared dataset.
        self.name = _content_name(self.path.read_bytes())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # The Rust side parallelises batches across cores.
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def load_tokenizer(spec: str | None) -> ByteTokenizer | HFTokenizer:
    """``None`` or ``"byte"``: byte tokenizer; otherwise a tokenizer.json path (or its folder)."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"tokenizer file not found: {path} "
            "(pass 'byte' or the path to a Hugging Face tokenizer.json)"
        )
    return HFTokenizer(path)


def keep_run_tokenizer(spec: str, run_dir: Path, expected: str | None = None) -> None:
    """RUN_DIR/tokenizer.json := the tokenizer file the run trains with: generate, export and
    post-training read the run's copy first (infer.load.run_tokenizer), so a moved, deleted or
    later edited original changes nothing. `expected`: the name (content hash) of the
    tokenizer the data was prepared with; a file that is not it (edited since) is never
    copied, and a copy that is not it (a run dir reused for a run on other data) is removed.
    Written whole (a reader never sees half of it)."""
    own = Path(run_dir) / "tokenizer.json"
    source = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    if spec == "byte":
        own.unlink(missing_ok=True)  # a byte-level run: a copy left by an earlier run is not its
        return
    data = source.read_bytes() if source.is_file() else None
    if data is not None and expected is not None and _content_name(data) != expected:
        data = None  # edited since the data was prepared: not what the ids mean
    if data is None:
        if own.is_file() and expected is not None and _content_name(own.read_bytes()) != expected:
            own.unlink()
        return
    if own.is_file() and own.read_bytes() == data:
        return
    tmp = own.with_name(f".tokenizer.json.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, own)


def _content_name(data: bytes) -> str:
    return "hf-" + hashlib.sha256(data).hexdigest()[:12]  # as HFTokenizer.name
