"""WANKA_OPS_BACKEND set directly (not from run.ops_backend, which check_forced vets): a value
that forces nothing must fail in one line that names the fix, never fall back silently to the
default backend."""

from __future__ import annotations

import pytest
import torch

from wanka import ops
from wanka.ops import registry


def _call():
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    idx = torch.tensor([[[0, -1], [1, 0], [2, 1]]])
    return ops.call("sparse_attention", q, k, v, idx, 0.5)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "sparse_atention=reference",
            r"there is no op 'sparse_atention'; did you mean "
            r"'sparse_attention'\?",
        ),  # fmt: skip
        ("sparse_attention=", r"'sparse_attention=' must look like op=backend"),
        ("=reference", r"'=reference' must look like op=backend"),
        ("*=", r"'\*=' must look like op=backend"),
        ("sparse_attention", r"'sparse_attention' must look like op=backend"),
    ],
)
def test_a_spec_that_forces_nothing_is_refused(monkeypatch, spec, message):
    monkeypatch.setenv(registry.ENV_OVERRIDE, spec)
    with pytest.raises(ValueError, match=f"^{registry.ENV_OVERRIDE}: {message}") as err:
        _call()
    assert "\n" not in str(err.value)


def test_a_backend_for_another_device_names_the_item_and_the_usable_ones(monkeypatch):
    monkeypatch.setenv(registry.ENV_OVERRIDE, "*=triton")
    with pytest.raises(ValueError, match=r"cannot run on cpu \(it runs on cuda\); drop "
                       r"\*=triton or force one of cpu, reference$"):  # fmt: skip
        _call()


def test_valid_specs_still_force(monkeypatch):
    for spec in ("sparse_attention=reference", " sparse_attention = reference , ", "*=reference"):
        monkeypatch.setenv(registry.ENV_OVERRIDE, spec)
        _call()
        assert registry._CHOICE[("sparse_attention", "cpu", spec)] == (("reference",), True)
