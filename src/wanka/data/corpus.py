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
    # hashlib, not hash(): Python's str hash is randomised per process.
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(
    docs: list[Document], val_fraction: float, seed: int, min_val_chars: int = 0
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/val split by document (never splits a document).

    Each document goes to val when its stable hash falls below ``val_fraction``. With a
    positive fraction at least one document goes to val and at least one stays in train
    (when there are two or more), so tiny datasets still get both splits. ``min_val_chars``:
    val holds at least that much text (or a tenth of all text, whichever is less), so a small
    corpus still yields an evaluation batch.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scores = [_unit_hash(seed, d.name) for d in docs]
    is_val = [s < val_fraction for s in scores]
    if val_fraction > 0 and len(docs) >= 2:
        if not any(is_val):
            is_val[min(range(len(docs)), key=scores.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    if val_fraction > 0 and min_val_chars > 0 and len(docs) >= 2:
        # Too little held-out text for one evaluation batch: move more documents (lowest hash
        # first, so the choice is still deterministic), up to a tenth of the text.
        total = sum(len(d.text) for d in docs)
        val_chars = sum(len(d.text) for d, v in zip(docs, is_val) if v)
        for i in sorted(range(len(docs)), key=scores.__getitem__):
            if val_chars >= min(min_val_chars, total // 10) or sum(not v for v in is_val) <= 1:
                break
            if not is_val[i]:
                is_val[i], val_chars = True, val_chars + len(docs[i].text)
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val
