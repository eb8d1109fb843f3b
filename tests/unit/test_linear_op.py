"""The registry's `linear`: the CPU backend's few-row orientation computes F.linear (values,
shapes, bias, gradients) whatever the row count, thread count or leading dims, and the
model's projections go through it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from wanka.models.layers import Linear
from wanka.ops import registry
from wanka.ops.linear import cpu as linear_cpu


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 2), (1, 5), (5, 1), (2, 3), (0,), (16,)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_f_linear(threads, n_threads, lead, bias):
    threads(n_threads)
    g = torch.Generator().manual_seed(len(lead) * 10 + sum(lead))
    x = torch.randn(*lead, 48, generator=g)
    w = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    out = linear_cpu.linear(x, w, b)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_cpu_linear_takes_a_1d_weight_as_f_linear_does(threads, rows):
    """F.linear takes a weight [in] (a dot product per row, output [...]): so must the few-row
    path, which reshaped the result to [rows, weight.shape[0]] and raised."""
    threads(2)
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 6, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(linear_cpu.linear(x, w), F.linear(x, w))


def test_cpu_linear_gradients_equal_f_linears(threads):
    threads(2)
    x = torch.randn(2, 2, 32, requires_grad=True)  # 4 rows: the reoriented path
    w = torch.randn(24, 32, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    gy = torch.randn(2, 2, 24)
    grads = torch.autograd.grad((linear_cpu.linear(x, w, b) * gy).sum(), (x, w, b))
    ref = torch.autograd.grad((F.linear(x, w, b) * gy).sum(), (x, w, b))
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_few_row_path_is_taken_only_where_it_was_measured_to_win(threads, monkeypatch):
    calls = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or real(a, b))
    w = torch.randn(16, 8)
    threads(2)
    for rows, used in [(1, False), (2, True), (5, True), (6, False), (64, False)]:
        calls.clear()
        linear_cpu.linear(torch.randn(rows, 8), w)
        assert bool(calls) is used, rows
    threads(1)  # one thread: the BLAS's own orientation is faster
    calls.clear()
    linear_cpu.linear(torch.randn(3, 8), w)
    assert not calls


def test_model_linears_dispatch_through_the_registry(monkeypatch):
    seen = []
    table = registry._REGISTRY["linear"]
    real = table["cpu"]
    spy = dataclasses.replace(real, fn=lambda *a: seen.append(1) or real.fn(*a))
    monkeypatch.setitem(table, "cpu", spy)
    layer = Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert seen == [1]
    assert set(layer.state_dict()) == {"weight"}  # same keys as nn.Linear (checkpoints, export)
