"""The compressed all-reduces on their own (2 and 4 gloo ranks): error feedback keeps the
running sum of what was sent equal to the running sum of the true gradients, minus what is
still held back, to float precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.helpers import spawn, spawn_in_turn
from wanka.distributed.compression import (
    Bf16Reducer,
    Int8Reducer,
    PowerSGDReducer,
    dequantize_int8,
    load_reducer_states,
    quantize_int8,
    reducer_states,
)

LAYOUT = [torch.Size([48, 40]), torch.Size([40]), torch.Size([3, 16, 8])]
NUMEL = sum(s.numel() for s in LAYOUT)
STEPS = 12
EF_METHODS = ["int8", "int8_flat", "powersgd"]


def _grad(rank: int, step: int) -> torch.Tensor:
    """A steady rank-2 part per matrix (what training gradients mostly are) plus noise."""
    base = torch.Generator().manual_seed(rank)
    u, v = torch.randn(48, 2, generator=base), torch.randn(2, 40, generator=base)
    u3, v3 = torch.randn(48, 2, generator=base), torch.randn(2, 8, generator=base)
    steady = torch.cat([(u @ v).view(-1), torch.randn(40, generator=base), (u3 @ v3).view(-1)])
    x = steady + 0.3 * torch.randn(
        NUMEL, generator=torch.Generator().manual_seed(100 * rank + step)
    )
    x[1920:1960] *= 1e-3  # a small-gradient 1-D parameter next to large ones
    return x


def _run(out: str, method: str) -> None:
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        reducer = {"bf16": lambda: Bf16Reducer(group),
                   "int8": lambda: Int8Reducer(group, 32, LAYOUT),
                   "int8_flat": lambda: Int8Reducer(group, 32),
                   "powersgd": lambda: PowerSGDReducer(group, LAYOUT, rank=2),
                   "powersgd_start": lambda: PowerSGDReducer(group, LAYOUT, rank=2, start=3)}[method]()  # fmt: skip
        sent, true = torch.zeros(NUMEL), torch.zeros(NUMEL)
        outs, totals = [], []
        for t in range(STEPS):
            g = _grad(dist.get_rank(), t)
            total = g.clone()
            dist.all_reduce(total)
            flat = g.clone()
            reducer(flat)
            sent += flat
            true += total
            outs.append(flat)
            totals.append(total)
        held = torch.zeros(NUMEL)
        reducer.commit()  # the last step's residuals
        if method.startswith("int8"):  # the rank's own residual, mapped back to flat positions
            where, _ = reducer.index(NUMEL, torch.device("cpu"))
            err = reducer.state["err"]
            held = err[:NUMEL].clone() if where is None else err[where].clone()
            # The owner's residual of the summed chunk: gathered so every rank sees all of it.
            es = reducer.state["err_sum"]
            full = es.new_empty(es.numel() * dist.get_world_size())
            dist.all_gather_into_tensor(full, es)
            held_sum = full[:NUMEL] if where is None else full[where]
            dist.all_reduce(held)
            held = held + held_sum
        elif method.startswith("powersgd"):
            held = reducer.state["err"].clone()
            dist.all_reduce(held)
        torch.save({"sent": sent, "true": true, "held": held, "outs": outs, "totals": totals},
                   Path(out) / f"rank{dist.get_rank()}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


# 4 ranks in CI; 2 (the same code with fewer peers) in `make test-slow` (CI time budget).
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("method", EF_METHODS)
def test_error_feedback_conserves_the_gradient_sum(request, tmp_path, method, world):
    if world == 4:  # the three methods ran in turn, in one spawn
        out = request.getfixturevalue("four_ranks") / method
    else:
        out = tmp_path
        spawn(world, _run, str(out), method)
    res = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    for r in range(1, world):  # every rank received the same bits, every step
        for a, b in zip(res[0]["outs"], res[r]["outs"]):
            assert torch.equal(a, b)
    r0 = res[0]
    # sum of sent = sum of true - residuals still held back (telescoping error feedback)
    assert torch.allclose(r0["sent"] + r0["held"], r0["true"], rtol=1e-5, atol=1e-4)
    assert r0["held"].abs().max() > 0, "nothing held back: is compression running at all?"
    # ... and what is held back stays bounded instead of growing with the steps.
    assert r0["held"].norm() < 0.5 * r0["true"].norm()


def _rollback(out: str, method: str) -> None:
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        make = {"int8": lambda: Int8Reducer(group, 32, LAYOUT),
                "powersgd": lambda: PowerSGDReducer(group, LAYOUT, rank=2)}[method]  # fmt: skip
        kept, retried = make(), make()
        outs = {"kept": [], "retried": []}
        for t in range(4):
            g = _grad(dist.get_rank(), t)
            if t == 2:  # a step computed, rejected and recomputed: must leave no trace
                bad = g * 1e3
                retried(bad)
                retried.rollback()
            for name, r in (("kept", kept), ("retried", retried)):
                flat = g.clone()
                r(flat)
                r.commit()
                outs[name].append(flat)
        torch.save(outs, Path(out) / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_rolled_back_step_leaves_no_residual(two_ranks, method):
    res = torch.load(two_ranks / f"rollback-{method}" / "rank0.pt")
    for a, b in zip(res["kept"], res["retried"], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(res["kept"][0], res["kept"][1])


def test_powersgd_starts_after_exact_steps(two_ranks):
    r0 = torch.load(two_ranks / "run-powersgd_start" / "rank0.pt")
    for t in range(3):  # exact (fp32 all-reduce) while it has not started
        assert torch.equal(r0["outs"][t], r0["totals"][t])
    assert not torch.allclose(r0["outs"][3], r0["totals"][3], rtol=1e-3)
    assert torch.allclose(r0["sent"] + r0["held"], r0["true"], rtol=1e-5, atol=1e-4)


def test_bf16_reduce_is_close_and_identical(two_ranks):
    a, b = (torch.load(two_ranks / "run-bf16" / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
    rel = (a["sent"] - a["true"]).norm() / a["true"].norm()
    assert 0 < rel < 1e-2


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    """_run of every error-feedback method on 4 ranks, in turn in one spawn: DIR/METHOD/."""
    out = tmp_path_factory.mktemp("four_ranks")
    for method in EF_METHODS:
        (out / method).mkdir()
    spawn_in_turn(4, *((_run, str(out / m), m) for m in EF_METHODS))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """The 2-rank cases below, in turn in one spawn, each in its own folder: DIR/CASE/."""
    out = tmp_path_factory.mktemp("two_ranks")
    calls = {"rollback-int8": (_rollback, "int8"), "rollback-powersgd": (_rollback, "powersgd"),
             "run-powersgd_start": (_run, "powersgd_start"), "run-bf16": (_run, "bf16"),
             "gather": (_gather,), "restart-int8": (_restart, "int8"),
             "restart-powersgd": (_restart, "powersgd")}  # fmt: skip
    for case in calls:
        (out / case).mkdir()
    spawn_in_turn(2, *((fn, str(out / case), *args) for case, (fn, *args) in calls.items()))
    return out


def test_int8_quantisation_roundtrip():
    x = torch.randn(4 * 64)
    x[:64] *= 1e-4  # its own block: its own scale
    q, s = quantize_int8(x, 64)
    assert q.dtype == torch.int8 and s.shape == (4,)
    y = dequantize_int8(q, s, 64)
    assert ((y - x).abs() <= s.repeat_interleave(64) / 2 + 1e-12).all()
    assert (q.abs() <= 127).all()


def _gather(out: str) -> None:
    from wanka.distributed.compression import Int8AllGather

    dist.init_process_group("gloo")
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        sizes = [s.numel() for s in LAYOUT]
        shards = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        for s in shards:
            s[1920:1960] = 1.0 + 0.01 * s[1920:1960]  # a norm weight beside small matrices
        exact = torch.cat(shards)
        output = torch.empty(n * NUMEL)
        output[rank * NUMEL : (rank + 1) * NUMEL] = shards[rank]  # FSDP2 gathers in place
        Int8AllGather(sizes, 32)(output, output[rank * NUMEL : (rank + 1) * NUMEL], None)
        torch.save({"got": output, "exact": exact}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_int8_param_gather(two_ranks):
    a, b = (torch.load(two_ranks / "gather" / f"rank{r}.pt") for r in range(2))
    assert torch.equal(a["got"], b["got"]), "ranks must compute with the same weights"
    err = (a["got"] - a["exact"]).abs().view(2, NUMEL)
    # Per-parameter blocks: the norm weight (~1.0) does not coarsen its neighbours' scale.
    small = torch.cat([err[:, :1920], err[:, 1960:]], 1)
    assert small.max() < 4.5 / 127 / 2 * 1.01  # |x| < 4.5 sigma: half a step of its block
    assert err[:, 1920:1960].max() < 1.05 / 127 / 2 * 1.01
    assert err.max() > 0


def _restart(out: str, method: str) -> None:
    """Steps 0-5 with one reducer; and steps 0-2, then the state through torch.save/load into
    a fresh reducer (a resumed job), steps 3-5: the same bits."""
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        make = {"int8": lambda: Int8Reducer(group, 32, LAYOUT),
                "powersgd": lambda: PowerSGDReducer(group, LAYOUT, rank=2, start=1)}[method]  # fmt: skip
        rank = dist.get_rank()

        def steps(reducer, ts):
            outs = []
            for t in ts:
                flat = _grad(rank, t)
                reducer(flat)
                reducer.commit()
                outs.append(flat)
            return outs

        whole = steps(make(), range(6))
        first = make()
        steps(first, range(3))
        path = Path(out) / f"state{rank}.pt"
        torch.save(first.state_dict(), path)
        resumed, fresh = make(), make()
        resumed.load_state_dict(torch.load(path, weights_only=True))
        torch.save({"whole": whole, "resumed": steps(resumed, range(3, 6)),
                    "fresh": steps(fresh, range(3, 6))}, Path(out) / f"rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_saved_error_feedback_resumes_bitwise(two_ranks, method):
    res = torch.load(two_ranks / f"restart-{method}" / "rank0.pt")
    for a, b in zip(res["whole"][3:], res["resumed"], strict=True):
        assert torch.equal(a, b)
    # Control: restarting the residuals at zero (what resumes did before) is not the same.
    assert not torch.equal(res["whole"][3], res["fresh"][0])


def test_reducer_states_refuse_another_layout():
    model = torch.nn.Linear(2, 2)
    assert reducer_states(model) == [] and load_reducer_states(model, [])
    model.grad_reducers = [Bf16Reducer(None)]
    assert not load_reducer_states(model, [{"kind": "Int8Reducer", "layout": [], "state": {}}])
    assert not load_reducer_states(model, [])  # another number of reducers
    assert load_reducer_states(model, reducer_states(model))


def _relayout(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        a = PowerSGDReducer(group, LAYOUT, rank=2)
        for t in range(2):
            flat = _grad(dist.get_rank(), t)
            a(flat)
            a.commit()
        sd = a.state_dict()
        assert sd["kept"] == 2 and sd["state"]
        model = torch.nn.Linear(2, 2)
        model.grad_reducers = [PowerSGDReducer(group, LAYOUT, rank=4)]  # another rank
        fits_other_rank = load_reducer_states(model, [sd])
        model.grad_reducers = [Int8Reducer(group, 32, LAYOUT)]  # another method
        fits_other_method = load_reducer_states(model, [sd])
        model.grad_reducers = [PowerSGDReducer(group, LAYOUT, rank=2)]
        fits = load_reducer_states(model, [sd])
        kept = model.grad_reducers[0].kept
        torch.save([fits_other_rank, fits_other_method, fits, kept], Path(out) / "r.pt")
    finally:
        dist.destroy_process_group()


def test_state_of_another_rank_or_method_does_not_load(tmp_path):
    spawn(1, _relayout, str(tmp_path))
    assert torch.load(tmp_path / "r.pt") == [False, False, True, 2]
