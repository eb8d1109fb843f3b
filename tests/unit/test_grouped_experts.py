"""grouped_swiglu: every backend matches the reference loop (outputs and gradients) on empty
experts, all rows on one expert, odd shapes, no rows; grouped_mm is CPU's default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wanka.ops import registry
from wanka.ops.grouped_experts import padded  # (importing it registers the op)

OP = "grouped_swiglu"
FAST = ["padded_bmm", "grouped_mm"]


def _inputs(counts, D=16, H=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    tokens = torch.randn(R, D, generator=g).to(dtype)
    ws = [torch.randn(E, D, H, generator=g), torch.randn(E, D, H, generator=g),
          torch.randn(E, H, D, generator=g)]  # fmt: skip
    ws = [(w / D**0.5).to(dtype) for w in ws]
    return tokens, torch.tensor(counts), ws


def _run(backend, tokens, counts, ws, grad=None):
    """Output and gradients of (tokens, w1, w3, w2) with one backend."""
    leaves = [t.detach().clone().requires_grad_() for t in (tokens, *ws)]
    y = registry.backends(OP)[backend].fn(leaves[0], counts, *leaves[1:])
    # a view returned from an FSDP2-wrapped module makes FSDP warn on every step
    assert y._base is None, f"{backend} returned a view"
    if grad is None:
        y.sum().backward()  # a stride-0 output gradient
    else:
        y.backward(grad)
    return [y.detach(), *(t.grad for t in leaves)]


def _check(backend, counts, D=16, H=8, dtype=torch.float32, tol=None):
    tokens, c, ws = _inputs(counts, D, H, dtype)
    grad = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1)).to(dtype)
    for g in (grad, None):
        ref = _run("reference", tokens, c, ws, g)
        got = _run(backend, tokens, c, ws, g)
        for name, a, b in zip(["out", "d_tokens", "d_w1", "d_w3", "d_w2"], got, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, **(tol or {"rtol": 1e-5, "atol": 1e-6}), msg=name)


CASES = {
    "balanced": [5, 5, 5, 5],
    "empty_experts": [0, 7, 0, 3],
    "all_on_one": [0, 0, 13, 0],
    "one_expert": [9],
    "no_rows": [0, 0, 0],
    "skewed_many": [40, 1, 0, 2, 0, 0, 1, 0],
}


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", CASES)
def test_backend_matches_reference_fp32(backend, case):
    _check(backend, CASES[case])


@pytest.mark.parametrize("backend", FAST)
def test_odd_shapes(backend):
    # dim 13, hidden 7: not 16-byte aligned, so grouped_mm takes its padded fallback
    _check(backend, [3, 0, 6, 2, 1], D=13, H=7)
    _check(backend, [3, 0, 6, 2, 1], D=12, H=20)


@pytest.mark.parametrize("backend", FAST)
def test_bf16(backend):
    _check(backend, [6, 0, 10, 4], D=32, H=16, dtype=torch.bfloat16,
           tol={"rtol": 2e-2, "atol": 2e-2})  # fmt: skip


@pytest.mark.parametrize("backend", FAST)
def test_autocast_matches_reference(backend):
    tokens, c, ws = _inputs([6, 0, 10, 4], D=32, H=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run("reference", tokens, c, ws)
        got = _run(backend, tokens, c, ws)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_padded_path_and_its_waste_fallback_are_both_exercised(monkeypatch):
    """Balanced counts take the padded bmm; a skewed one (padding > PAD_WASTE x) does not."""
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(padded.torch, "bmm", lambda *a: calls.append(1) or real_bmm(*a))
    tokens, c, ws = _inputs([5, 6, 5, 4])
    padded.padded_swiglu(tokens, c, *ws)
    assert len(calls) == 3
    calls.clear()
    tokens, c, ws = _inputs([200] + [1] * 15)
    padded.padded_swiglu(tokens, c, *ws)
    assert not calls


def test_cpu_default_is_grouped_mm_and_reference_is_the_loop(monkeypatch):
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    assert registry.select(OP, "cpu").name == "grouped_mm"
    assert registry.select(OP, "meta").name == "padded_bmm"  # devices without _grouped_mm
    monkeypatch.setenv(registry.ENV_OVERRIDE, f"{OP}=reference")
    assert registry.select(OP, "cpu").name == "reference"
    # the reference is literally the per-expert SwiGLU
    tokens, c, (w1, w3, w2) = _inputs([2, 3])
    y = registry.call(OP, tokens, c, w1, w3, w2)
    x = tokens[2:]
    torch.testing.assert_close(y[2:], (F.silu(x @ w1[1]) * (x @ w3[1])) @ w2[1])
