"""The checkpoint manifest is hashed by all ranks together (train/manifest.py): at a save each
rank hashes the files it wrote, at a check each its round-robin share, and every rank reaches
the same verdict. Rank 0 alone hashed everything before (most of an hour per 3.5 TB save), and
every rank hashed every file again at each resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.helpers import spawn
from wanka.train import manifest
from wanka.train.checkpoint import MARKER, Checkpointer, verify


def _counting(out: Path, what: str):
    """Wraps manifest.sha256_file to record which files this rank hashed."""
    real, seen = manifest.sha256_file, []

    def sha(path: Path) -> str:
        seen.append(Path(path).name)
        return real(path)

    manifest.sha256_file = sha
    return lambda: (out / f"{what}-rank{dist.get_rank()}.json").write_text(json.dumps(seen))


def _save_then_check(out: str, corrupt_step: int | None) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    out_dir = Path(out)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(out_dir / "checkpoints", model, opt, keep=3, async_save=False,
                      is_main=dist.get_rank() == 0)  # fmt: skip
    if corrupt_step is None:
        done = _counting(out_dir, "save")
        ck.save(1, {})
        ck.save(2, {})
        done()
    else:
        step = out_dir / "checkpoints" / f"step-{corrupt_step:08d}"
        dist.barrier()
        done = _counting(out_dir, "check")
        found = ck.latest_valid()
        done()
        (out_dir / f"found-rank{dist.get_rank()}.txt").write_text(str(found))
        ck.load(found, {})
        assert step.exists()
    dist.destroy_process_group()


def test_ranks_share_the_hashing_and_agree_on_damage(tmp_path):
    spawn(2, _save_then_check, str(tmp_path), None)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    assert verify(step2) is None  # the merged manifest is the full, right one
    files = json.loads((step2 / MARKER).read_text())["files"]
    own = {r: {n for n in files if manifest.writer_rank(n, 2) == r} for r in (0, 1)}
    assert own[1] and any(n.startswith("__1_") for n in own[1]) and ".metadata" in own[0]
    for r in (0, 1):  # two saves: each rank hashed exactly its own files, twice
        seen = json.loads((tmp_path / f"save-rank{r}.json").read_text())
        assert sorted(seen) == sorted(list(own[r]) * 2), (r, seen)

    # A flipped byte in a file rank 1 wrote: found by whichever rank checks it, agreed by both.
    victim = next(n for n in own[1] if n.endswith(".distcp"))
    data = bytearray((step2 / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step2 / victim).write_bytes(bytes(data))
    spawn(2, _save_then_check, str(tmp_path), 2)
    found = {(tmp_path / f"found-rank{r}.txt").read_text() for r in (0, 1)}
    assert found == {str(tmp_path / "checkpoints" / "step-00000001")}
    assert "does not match its checksum" in (step2 / "CORRUPT").read_text()
    checked = [json.loads((tmp_path / f"check-rank{r}.json").read_text()) for r in (0, 1)]
    n2, n1 = len(files), len(json.loads((tmp_path / "checkpoints" / "step-00000001" / MARKER)
                                        .read_text())["files"])  # fmt: skip
    # Step 2 (a rank stops at its first bad file) then step 1, round-robin: no file hashed
    # twice, none by every rank.
    assert n1 < sum(len(c) for c in checked) <= n2 + n1
    assert all(0 < len(c) <= (n2 + 1) // 2 + (n1 + 1) // 2 for c in checked)
    assert os.path.isdir(tmp_path / "checkpoints" / "step-00000001")
