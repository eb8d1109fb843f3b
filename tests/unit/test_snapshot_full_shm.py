"""A snapshot directory without room fails with ENOSPC at save time, never SIGBUS later."""

import errno

import pytest
import torch

from wanka.resilience.chaos import small_filesystem, tmpfs_unavailable
from wanka.resilience.snapshot import SnapshotStore


def test_snapshot_on_a_full_tmpfs_raises_enospc(tmp_path):
    why = tmpfs_unavailable()
    if why:
        pytest.skip(why)
    with small_filesystem(tmp_path / "shm", 1):
        store = SnapshotStore(tmp_path / "shm", "job", "n0", 0, 1, 1, replica=False, signature="s")
        store.save(1, {"w": torch.zeros(1000)})  # 4 KB: fits
        with pytest.raises(OSError) as e:
            store.save(2, {"w": torch.zeros(2_000_000)})  # 8 MB into a 1 MiB tmpfs
        assert e.value.errno == errno.ENOSPC
        # The committed snapshot of step 1 is untouched and still restorable.
        assert [p.name[:13] for p in store.dir.glob("*.meta")] == ["step-00000001"]
        store.close()
