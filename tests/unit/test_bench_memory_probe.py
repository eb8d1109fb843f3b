"""bench memory resets the peak RSS before each step: where that write is refused, or
accepted and ignored (sandboxed kernels), every step would report an older peak. Refused in
one line before any case runs."""

import pytest

from wanka.bench import memory


def test_an_ignored_reset_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_reset_hwm", lambda: None)
    assert "does not reset the peak" in memory._hwm_reset_problem()
    with pytest.raises(ValueError, match="clear_refs, which is accepted but does not reset"):
        memory.bench_memory_main(tmp_path / "m.json", quick=True)
    assert not (tmp_path / "m.json").exists()


def test_a_refused_reset_is_named(monkeypatch):
    def refused():
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(memory, "_reset_hwm", refused)
    assert memory._hwm_reset_problem() == "is refused (Permission denied)"


def test_an_ignored_reset_is_seen_after_the_heap_kept_freed_blocks():
    """A process whose heap is never trimmed (keep_freed_host_memory, as the trainer and the
    cp replay set) holds freed blocks resident: a probe allocated from malloc reused them,
    moved no peak, and an ignored reset passed as working (seen in CI: another test had run
    in the same worker). Run in a fresh process so that state is this test's own."""
    import subprocess
    import sys

    code = (
        "from wanka.bench import memory\n"
        "from wanka.device import keep_freed_host_memory\n"
        "keep_freed_host_memory()\n"
        "blocks = [bytearray(16 << 20) for _ in range(8)]\n"  # below the mmap threshold
        "for b in blocks:\n"
        "    b[::4096] = b'\\x01' * len(b[::4096])\n"
        "del blocks, b\n"  # 128 MiB of freed, resident heap
        "memory._reset_hwm = lambda: None\n"
        "print(memory._hwm_reset_problem())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "WANKA_HOST_MALLOC"))}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "does not reset the peak" in r.stdout, r.stdout
