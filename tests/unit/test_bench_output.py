"""A benchmark's results file: checked before minutes of measurement, written whole or not at
all. `wanka bench decode --out` on a full disk left 4096 bytes of broken JSON where the
previous results were; a read-only --out passed the check and failed after the run."""

from __future__ import annotations

import json
import subprocess

import pytest

from wanka.bench.output import check_out, write_out
from wanka.resilience.chaos import small_filesystem, tmpfs_unavailable

NO_TMPFS = tmpfs_unavailable()
needs_tmpfs = pytest.mark.skipif(NO_TMPFS is not None, reason=f"no tmpfs: {NO_TMPFS}")


@needs_tmpfs
def test_a_full_disk_leaves_the_previous_results_whole(tmp_path):
    with small_filesystem(tmp_path / "disk", 1) as disk:
        out = disk / "decode.json"
        before = json.dumps({"cases": [1, 2, 3]})
        write_out(out, before)
        with pytest.raises(ValueError, match="cannot write .*it is as it was") as e:
            write_out(out, json.dumps({"cases": ["x" * 100] * 20_000}))  # ~2 MB > 1 MiB
        assert "\n" not in str(e.value)
        assert out.read_text() == before
        assert [p.name for p in disk.iterdir()] == ["decode.json"]  # no temporary left


@needs_tmpfs
def test_a_read_only_out_is_refused_before_the_benchmark_runs(tmp_path):
    with small_filesystem(tmp_path / "ro", 1) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        with pytest.raises(ValueError, match="--out .*cannot write in .*Read-only"):
            check_out(ro / "decode.json")
    with pytest.raises(ValueError, match="is a directory"):
        check_out(tmp_path)
    check_out(tmp_path / "new" / "r.json")  # a folder to make: fine
    assert not [p for p in (tmp_path / "new").iterdir()]  # the probe is gone
