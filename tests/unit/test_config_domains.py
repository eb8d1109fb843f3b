"""Numerically absurd settings are refused at load time, naming the field (they used to run:
lr = inf checkpointed a NaN model and exited 0; steps = 1e20 hung `wanka check`)."""

import pytest

from wanka.config import ConfigError, load_config

BAD = [
    ("train.lr=inf", "train.lr"), ("train.lr=nan", "train.lr"), ("train.lr=0", "train.lr"),
    ("train.lr=5", "train.lr"), ("train.grad_clip=nan", "train.grad_clip"),
    ("train.grad_clip=-1", "train.grad_clip"), ("train.indexer_lr=-0.1", "train.indexer_lr"),
    ("model.route_scale=-1", "model.route_scale"), ("model.route_scale=0", "model.route_scale"),
    ("model.norm_eps=0", "model.norm_eps"), ("model.norm_eps=-1e-6", "model.norm_eps"),
    ("train.beta1=1", "train.beta1"), ("train.beta1=1.5", "train.beta1"),
    ("train.beta2=-0.1", "train.beta2"), ("train.weight_decay=1e9", "train.weight_decay"),
    ("train.steps=100000000000000000000", "train.steps"), ("train.steps=1e20", "train.steps"),
    ("model.init_std=0", "model.init_std"), ("model.mtp_loss_weight=-1", "model.mtp_loss_weight"),
    ("model.seq_balance_loss_weight=inf", "model.seq_balance_loss_weight"),
    ("model.rope_theta=0.5", "model.rope_theta"), ("checkpoint.mtbf_s=inf", "checkpoint.mtbf_s"),
    ("resilience.hang_factor=nan", "resilience.hang_factor"),
    ("model.bias_update_rate=-1", "model.bias_update_rate"),
    ("train.decay_fraction=0", "train.decay_fraction"),
    ("model.n_expert_groups=3", "model.n_expert_groups"),
    ("train.seed=-1", "train.seed"), ("run.device=gpu", "run.device"),
    ("run.ops_backend=nonsense", "run.ops_backend"), ("run.ops_backend==cpu", "run.ops_backend"),
    ("resilience.backoff_max_s=-1.0", "resilience.backoff_max_s"),
    ("resilience.evict_window_s=-5.0", "resilience.evict_window_s"),
    ('run.dir=""', "run.dir"), ('run.dir="  "', "run.dir"),
]  # fmt: skip


@pytest.mark.parametrize("override,field", BAD)
def test_absurd_value_is_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert msg.startswith(f"config error at {field}:"), msg
    assert "\n" not in msg


def test_lr_times_weight_decay_at_least_one_is_refused():
    with pytest.raises(ConfigError, match="train.weight_decay"):
        load_config(None, ["train.lr=1.0", "train.weight_decay=1.0"])


@pytest.mark.parametrize("override", ["train.lr=1e-4", "train.beta1=0", "train.weight_decay=0",
                                      "train.grad_clip=0", "model.norm_eps=1e-5"])  # fmt: skip
def test_sensible_values_pass(override):
    load_config(None, [override])
