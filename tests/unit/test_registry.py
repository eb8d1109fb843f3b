"""The op registry: a new backend is a new file in the op's package, picked by device type and
priority, forced by WANKA_OPS_BACKEND, and a forced backend that cannot run is refused."""

from __future__ import annotations

import sys

import pytest
import torch

from wanka.ops import registry


@pytest.fixture
def scratch_op(monkeypatch, tmp_path):
    """A throwaway op package `chipops` with a reference backend, on sys.path."""
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    pkg = tmp_path / "chipops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from wanka.ops.registry import import_backends\nimport_backends(__name__, __path__)\n"
    )
    (pkg / "reference.py").write_text(
        "from wanka.ops.registry import register\n"
        "@register('scratch_double', 'reference')\n"
        "def double(x):\n    return x * 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    registry._REGISTRY.pop("scratch_double", None)
    for name in [m for m in sys.modules if m == "chipops" or m.startswith("chipops.")]:
        del sys.modules[name]


def test_a_new_chip_is_one_new_file(scratch_op, monkeypatch):
    (scratch_op / "mychip.py").write_text(
        "from wanka.ops.registry import register\n"
        "@register('scratch_double', 'mychip', device_types=('cpu',), priority=5)\n"
        "def double(x):\n    return x + x + 0.5\n"  # distinguishable from the reference
    )
    __import__("chipops")
    assert set(registry.backends("scratch_double")) == {"reference", "mychip"}
    assert registry.call("scratch_double", torch.ones(2)).tolist() == [2.5, 2.5]
    assert registry.select("scratch_double", "meta").name == "reference"  # not its device
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_double=reference")
    assert registry.call("scratch_double", torch.ones(2)).tolist() == [2.0, 2.0]
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_double=mychip")
    with pytest.raises(ValueError, match="cannot run on meta"):
        registry.select("scratch_double", "meta")
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_double=nochip")
    with pytest.raises(ValueError, match="has no backend 'nochip'"):
        registry.select("scratch_double", "cpu")


def test_a_backend_whose_vendor_library_is_missing_does_not_break_the_others(scratch_op):
    (scratch_op / "otherchip.py").write_text(
        "import vendor_runtime_that_is_not_installed\n"
        "from wanka.ops.registry import register\n"
        "@register('scratch_double', 'otherchip', priority=9)\n"
        "def double(x):\n    return x\n"
    )
    with pytest.warns(UserWarning, match="otherchip not loaded: it needs 'vendor_runtime"):
        __import__("chipops")
    assert set(registry.backends("scratch_double")) == {"reference"}
    assert registry.call("scratch_double", torch.ones(1)).tolist() == [2.0]


def test_unknown_op_names_the_registered_ones():
    with pytest.raises(KeyError, match="sparse_attention"):
        registry.backends("no_such_op")


def test_dense_attention_sdpa_serves_devices_without_their_own_kernel(monkeypatch):
    """A device without a dense kernel of its own (here: an NPU) gets SDPA per document, not the
    materialised reference; forced by name, the backend gives the reference's result."""
    from wanka.ops.dense_attention import reference

    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    assert registry.select("dense_attention", "npu").name == "sdpa"
    assert registry.select("dense_attention", "cpu").name == "cpu"
    monkeypatch.setenv(registry.ENV_OVERRIDE, "dense_attention=sdpa")
    q, k, v = torch.randn(2, 19, 3, 8), torch.randn(2, 19, 8), torch.randn(2, 19, 8)
    doc = torch.tensor([[0] * 7 + [1] * 12, [0] * 19])
    got = registry.call("dense_attention", q, k, v, doc, 0.4)
    torch.testing.assert_close(got, reference.dense_attention(q, k, v, doc, 0.4))


def test_the_choice_is_cached_but_follows_registrations_overrides_and_replacements(
    scratch_op, monkeypatch
):
    __import__("chipops")
    x = torch.ones(2)
    assert registry.call("scratch_double", x).tolist() == [2.0, 2.0]
    assert registry._CHOICE[("scratch_double", "cpu", "")] == (("reference",), False)
    # a backend registered after the first call wins from the next call on
    registry.register("scratch_double", "late", priority=7)(lambda t: t * 3)
    assert registry.call("scratch_double", x).tolist() == [3.0, 3.0]
    # a changed override is a new choice, and going back to none restores the old one
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_double=reference")
    assert registry.call("scratch_double", x).tolist() == [2.0, 2.0]
    monkeypatch.delenv(registry.ENV_OVERRIDE)
    assert registry.call("scratch_double", x).tolist() == [3.0, 3.0]
    # a backend replaced in place (benchmarks wrap fn) is the one called
    table = registry._REGISTRY["scratch_double"]
    table["late"] = registry.Backend("late", lambda t: t * 4, ("*",), 7, lambda: True)
    assert registry.call("scratch_double", x).tolist() == [4.0, 4.0]
    # a removed one is not called
    del table["late"]
    assert registry.call("scratch_double", x).tolist() == [2.0, 2.0]


def test_reset_choices_sees_a_changed_availability(scratch_op):
    __import__("chipops")
    state = {"up": True}
    registry.register("scratch_double", "vendor", priority=5, available=lambda: state["up"])(
        lambda t: t * 5
    )
    assert registry.call("scratch_double", torch.ones(1)).tolist() == [5.0]
    state["up"] = False  # the vendor library went away (a test faking it)
    registry.reset_choices()
    assert registry.call("scratch_double", torch.ones(1)).tolist() == [2.0]
