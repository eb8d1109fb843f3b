"""Activation checkpointing (full, selective) changes memory, not results: same losses,
gradients and expert loads as without it, on 1 rank and on 2 ranks (dp 2 x ep 2)."""

import pytest
import torch

from tests.distributed.helpers import losses, spawn, spawn_jobs
from tests.distributed.parallel_step import run_variants

MODES = {mode: {"ac_mode": mode} for mode in ("off", "full", "selective")}


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_matches_no_checkpointing(tmp_path, world):
    out = tmp_path / "results.pt"
    spawn(world, run_variants, str(out), world, MODES)
    res = torch.load(out)
    off = res["off"]
    assert off["loads"].sum() > 0
    for mode in ("full", "selective"):
        r = res[mode]
        # Recomputation repeats the same float operations on the same inputs (CPU): bitwise.
        assert torch.equal(r["sums"], off["sums"]), mode
        assert r["grads"].keys() == off["grads"].keys()
        for name, g in off["grads"].items():
            assert torch.equal(r["grads"][name], g), f"{mode}: grad of {name}"
        # The MoE counts routed tokens in forward; a recomputation must not count them again.
        assert torch.equal(r["loads"], off["loads"]), mode


def test_checkpointed_jobs_match(job_args, tmp_path):
    """Whole 2-rank jobs (dp 2 x ep 2, 2 micro-batches, expert-bias updates): equal losses."""
    common = ["train.micro_batch_size=1", "train.grad_accum=2", "parallel.ep=2",
              "checkpoint.enable=false"]  # fmt: skip
    modes = ("off", "full", "selective")
    spawn_jobs(2, *(job_args(m, *common, f'train.activation_checkpointing="{m}"') for m in modes))
    off = losses(tmp_path / "off")
    assert len(off) == 4
    assert losses(tmp_path / "full") == off == losses(tmp_path / "selective")


def test_checkpointing_keeps_parameter_names():
    """Checkpoints and optimizer groups see the same names whatever the mode."""
    from tests.distributed.parallel_step import CFG
    from wanka.distributed.activation_checkpoint import apply_activation_checkpointing
    from wanka.models.transformer import Transformer

    names = {}
    for mode in MODES:
        model = Transformer(CFG)
        apply_activation_checkpointing(model, mode)
        names[mode] = list(model.state_dict())
    assert names["full"] == names["off"] == names["selective"]


def test_unknown_mode_is_rejected():
    from tests.distributed.parallel_step import CFG
    from wanka.distributed.activation_checkpoint import apply_activation_checkpointing
    from wanka.models.transformer import Transformer

    with pytest.raises(ValueError, match="selective"):
        apply_activation_checkpointing(Transformer(CFG), "some")
