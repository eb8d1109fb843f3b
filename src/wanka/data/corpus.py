"""The built-in corpus: Python's own standard library sources and documentation.

Every Python installation ships these, so a first training run needs no download.
Documents are kept whole (one per file or doc topic); packing happens in the loader.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Third-party code is not part of the standard library and varies between machines.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def stdlib_documents() -> list[Document]:
    """Every UTF-8 decodable, non-empty ``*.py`` file of the stdlib, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts) and p.is_file()
    )
    docs = []
    for rel in rel_paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # the test suite has deliberately mis-encoded files
        if text.strip():
            docs.append(Document(f"stdlib:{rel}", text))
    return docs


def pydoc_documents() -> list[Document]:
    """Each topic of the bundled Python documentation as its own document."""
    from pydoc_data.topics import topics

    return [
        Document(f"pydoc:{name}", topics[name]) for name in sorted(topics) if topics[name].strip()
    ]


def builtin_documents() -> list[Document]:
    return stdlib_documents() + pydoc_documents()


def _unit_hash(seed: int, name: str) -> float:
    # hashlib, not hash(): Python's str hash is randomised per process. surrogateescape: a
    # file name that is not UTF-8 (Latin-1 from an old archive) holds undecodable bytes.
    digest = hashlib.sha256(f"{seed}\0{name}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(
    docs: list[Document], val_fraction: float, seed: int, min_val_chars: int = 0
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/val split by document (never splits a document).

    Each document goes to val when its stable hash falls below ``val_fraction``. With a
    positive fraction at least one document goes to val and at least one stays in train
    (when there are two or more), so tiny datasets still get both splits. ``min_val_chars``:
    val holds at least that much text (or a tenth of all text, whichever is less), so a small
    corpus still yields an evaluation batch. Documents chosen to fill val rather than drawn
    skip any that would hold out far more than that, and val never holds more than half.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scores = [_unit_hash(seed, d.name) for d in docs]
    is_val = [s < val_fraction for s in scores]
    if val_fraction == 0 or len(docs) < 2:
        return _parts(docs, is_val)
    size = [len(d.text) for d in docs]
    total = sum(size)
    target = min(min_val_chars, total // 10)
    # A document chosen to fill val (not drawn by its hash) must not hold out much more than
    # asked: one big file would otherwise leave a sliver to train on.
    cap = min(max(2 * target, total // 10, int(total * val_fraction)), total // 2)
    by_hash = sorted(range(len(docs)), key=scores.__getitem__)
    while sum(s for s, v in zip(size, is_val) if v) > total // 2:  # drawn: never past half
        is_val[max((i for i in by_hash if is_val[i]), key=size.__getitem__)] = False
    if not any(is_val):
        fits = [i for i in by_hash if size[i] <= cap]
        is_val[fits[0] if fits else min(by_hash, key=size.__getitem__)] = True
    if all(is_val):
        is_val[by_hash[-1]] = False
    val_chars = sum(s for s, v in zip(size, is_val) if v)
    for i in by_hash:  # too little for one evaluation batch: more, lowest hash first
        if val_chars >= target or sum(not v for v in is_val) <= 1:
            break
        if not is_val[i] and val_chars + size[i] <= cap:
            is_val[i], val_chars = True, val_chars + size[i]
    return _parts(docs, is_val)


def _parts(docs: list[Document], is_val: list[bool]) -> tuple[list[Document], list[Document]]:
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val
