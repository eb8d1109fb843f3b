"""torch.compile per block: same results as eager, alone and under activation checkpointing."""

import pytest
import torch

from tests.distributed.helpers import spawn
from tests.distributed.parallel_step import run_variants


def _check(res: dict, ref: str, rtol: float) -> None:
    base = res[ref]
    for name, r in res.items():
        if name == ref:
            continue
        assert r["graphs"] > 0, f"{name}: nothing was compiled"
        dev = ((r["sums"] - base["sums"]).abs() / base["sums"].abs()).max()
        assert dev < rtol, f"{name}: loss sums deviate by {dev:.2e}"
        for n, g in base["grads"].items():
            d = float((r["grads"][n] - g).norm() / g.norm().clamp(min=1e-30))
            assert d < rtol, f"{name}: gradient of {n} deviates by {d:.2e}"
        assert torch.equal(r["loads"], base["loads"]), name


def test_dynamo_capture_matches_eager(tmp_path):
    """Dynamo only (backend "eager": graph capture, graph breaks, guards; no code generation),
    in every activation-checkpointing mode: equal to eager up to float reassociation."""
    variants = {"eager": {}}
    for mode in ("off", "full", "selective"):
        variants[f"dynamo-{mode}"] = {"compile": "eager", "ac_mode": mode}
    out = tmp_path / "results.pt"
    spawn(1, run_variants, str(out), 1, variants, {"n_layers": 2})
    _check(torch.load(out), "eager", rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_inductor_matches_eager(tmp_path, world):
    """Inductor-compiled blocks (CPU C++ code) vs eager: measured within 2e-6 (relative)."""
    variants = {
        "eager": {},
        "inductor": {"compile": True},
        "inductor-selective": {"compile": True, "ac_mode": "selective"},
    }
    out = tmp_path / "results.pt"
    spawn(world, run_variants, str(out), world, variants)
    _check(torch.load(out), "eager", rtol=1e-4)
