"""A checkpoint's manifest (its COMPLETE marker): size and SHA-256 of every file, hashed by all
ranks together.

Rank 0 hashing every rank's files alone, while the others waited, cost about a minute per 70 GB
at this machine's 1.2 GB/s: for a 3.5 TB checkpoint of the production shape, most of an hour
per save (past the hang limit), and every rank hashed all of them again at each resume. So at a
save each rank hashes the files it wrote itself (DCP's ``__RANK_N.distcp``, its rank-local
file; still in its page cache), rank 0 the rest (DCP's ``.metadata``), and rank 0 writes the
merged manifest. A check shares the files round-robin over the ranks of the job doing the
check (any world size: a checkpoint saved by N ranks is checked by M): every rank reads the
manifest, and checks presence, size and checksum of its share of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

MARKER = "COMPLETE"
CORRUPT = "CORRUPT"
RANK_LOCAL = "rank-local-"  # + RANK.pt: state only that rank holds (error feedback)
_WRITER = re.compile(rf"^(?:__(\d+)_\d+\.distcp|{re.escape(RANK_LOCAL)}(\d+)\.pt)$")

Files = dict[str, list]  # name -> [size, sha256]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()
                  if p.is_file() and p.name not in (MARKER, CORRUPT) and not p.name.startswith(f".{MARKER}"))  # fmt: skip


def writer_rank(name: str, world: int) -> int:
    """The rank that wrote file `name` of a checkpoint being saved by `world` ranks (0 for
    files no single rank wrote, e.g. DCP's .metadata)."""
    m = _WRITER.match(name)
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world else 0


def hash_own_files(path: Path, rank: int, world: int) -> Files:
    """[size, sha256] of the files of `path` that `rank` hashes at a save."""
    return {n: [(path / n).stat().st_size, sha256_file(path / n)]
            for n in _data_files(path) if writer_rank(n, world) == rank}  # fmt: skip


def write_manifest(path: Path, step: int, hashed: Files | None = None) -> None:
    """Write the COMPLETE marker of `path`. `hashed`: entries the ranks computed (any file
    they missed, or all when None, is hashed here)."""
    hashed = hashed or {}
    files = {n: hashed.get(n) or [(path / n).stat().st_size, sha256_file(path / n)]
             for n in _data_files(path)}  # fmt: skip
    tmp = path / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "files": files}))
    os.replace(tmp, path / MARKER)


def named_step(path: Path) -> int | None:
    """The step a checkpoint folder's name says (step-00000100 -> 100); None for any other
    name (step-00000100.bak, a user's copy, is not a checkpoint of this run)."""
    head, _, digits = path.name.partition("-")
    return int(digits) if head == "step" and digits.isascii() and digits.isdigit() else None


def manifest_problem(path: Path, rank: int = 0, world: int = 1, checksums: bool = True
                     ) -> str | None:  # fmt: skip
    """What is wrong with checkpoint `path` (one line) or None: the manifest, then presence,
    size and (`checksums`) SHA-256 of this rank's round-robin share of its files (world = 1:
    all of them). OSError (no permission, I/O errors) propagates."""
    try:
        manifest = json.loads((path / MARKER).read_text())
        files = manifest["files"]
        entries = sorted((str(n), int(s), str(d)) for n, (s, d) in files.items())
    except (ValueError, KeyError, TypeError, AttributeError, FileNotFoundError, IsADirectoryError):
        return f"{path.name}: no readable manifest"
    named = named_step(path)
    if named is not None and manifest.get("step") != named:
        return (f"{path.name}: its manifest is of step {manifest.get('step')} (a copy under "
                "another step's name?)")  # fmt: skip
    for i, (name, size, digest) in enumerate(entries):
        if i % world != rank:
            continue
        f = path / name
        if not f.is_file():
            return f"{path.name}: {name} is missing"
        if f.stat().st_size != size:
            return f"{path.name}: {name} is {f.stat().st_size} bytes, manifest says {size} (truncated?)"
        if checksums and sha256_file(f) != digest:
            return f"{path.name}: {name} does not match its checksum (corrupted)"
    return None
