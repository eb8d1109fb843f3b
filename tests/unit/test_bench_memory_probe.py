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
