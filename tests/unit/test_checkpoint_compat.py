"""A checkpoint written before a new train-state key (e.g. the LR schedule record) or a new
[model] field still loads: new keys are skipped, new fields compare as their defaults."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.helpers import free_port
from wanka.train.checkpoint import Checkpointer


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_old_checkpoint_without_newer_keys_loads(world_of_one, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    old_cfg = json.dumps({"dim": 128, "n_layers": 4})  # predates every later [model] field
    ck = Checkpointer(tmp_path / "ck", model, opt, keep=2, async_save=False, is_main=True)
    path = ck.save(1, {"loader": {"epoch": 3}, "model_config": old_cfg})
    ck.wait()
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    now_cfg = json.dumps({**json.loads(old_cfg), "seq_balance_loss_weight": 0.0})  # default
    # A key new at the top (lr_schedule) and one new inside a saved dict (the loader's data
    # size, added 2026-12-05: every older checkpoint failed to resume over it).
    template = {"loader": {"epoch": 0, "data_docs": 0}, "model_config": now_cfg,
                "lr_schedule": "{}"}  # fmt: skip
    state = ck.load(path, template)
    assert state["loader"] == {"epoch": 3} and "lr_schedule" not in state
    assert torch.equal(model.weight, weights)
    changed = json.dumps({**json.loads(old_cfg), "seq_balance_loss_weight": 0.5})
    with pytest.raises(ValueError, match="seq_balance_loss_weight"):
        ck.load(path, {**template, "model_config": changed})
