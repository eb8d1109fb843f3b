"""LR schedules (cosine, WSD) over a horizon, and the record that lets a resume notice a change."""

import json
import math

import pytest

from wanka.config.schema import TrainConfig
from wanka.train.optim import lr_factor, schedule_change, schedule_record


def wsd(**kw) -> TrainConfig:
    base = dict(steps=100, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1)
    return TrainConfig(**{**base, **kw})


def test_wsd_key_steps():
    c = wsd()  # 10 warm-up, stable, 20 decay steps (80..99)
    assert lr_factor(0, c) == pytest.approx(0.1)
    assert lr_factor(9, c) == 1.0  # warm-up ends at the full rate
    assert lr_factor(10, c) == lr_factor(79, c) == 1.0  # stable
    assert lr_factor(80, c) == pytest.approx(0.1 + 0.9 * 19 / 20)  # first decay step
    assert lr_factor(90, c) == pytest.approx(0.1 + 0.9 * 9 / 20)
    assert lr_factor(99, c) == 0.1  # exactly the floor at the last step of the horizon
    assert lr_factor(100, c) == lr_factor(10_000, c) == 0.1  # and it stays there
    rates = [lr_factor(s, c) for s in range(79, 100)]
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))  # linear, strictly down


def test_cosine_key_steps():
    c = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(9, c) == lr_factor(10, c) == 1.0
    mid = 10 + (99 - 10) / 2  # halfway through the cosine: halfway between 1 and the floor
    assert lr_factor(math.floor(mid), c) > 0.55 > lr_factor(math.ceil(mid), c)
    assert lr_factor(99, c) == 0.1
    assert lr_factor(100, c) == lr_factor(5_000, c) == 0.1


def test_horizon_is_independent_of_steps():
    for kind in ("cosine", "wsd"):
        short = wsd(lr_schedule=kind, steps=50, lr_horizon=100)
        full = wsd(lr_schedule=kind, steps=100)
        assert [lr_factor(s, short) for s in range(50)] == [lr_factor(s, full) for s in range(50)]
        longer = wsd(lr_schedule=kind, steps=300, lr_horizon=100)
        assert lr_factor(99, longer) == lr_factor(250, longer) == 0.1  # past it: the floor


def test_dense_warmup_prefix():
    c = wsd(dense_warmup_steps=10, warmup_steps=5)  # sparse stage: 90 steps, 18 of decay
    assert lr_factor(0, c) == pytest.approx(0.2)
    assert lr_factor(4, c) == lr_factor(9, c) == 1.0  # the indexer's own warm-up, then full
    assert lr_factor(10, c) == pytest.approx(0.2)  # the sparse stage warms up afresh
    assert lr_factor(14, c) == lr_factor(81, c) == 1.0
    assert lr_factor(82, c) == pytest.approx(0.1 + 0.9 * 17 / 18)
    assert lr_factor(99, c) == 0.1
    whole = wsd(dense_warmup_steps=10, warmup_steps=5, phase="dense_warmup")  # no prefix
    assert lr_factor(10, whole) == 1.0 and lr_factor(99, whole) == 0.1


def test_record_is_json_and_resolves_the_horizon():
    rec = schedule_record(wsd(lr=3e-4, indexer_lr=1e-3, dense_warmup_steps=4))
    assert json.loads(json.dumps(rec)) == rec
    assert rec["kind"] == "wsd" and rec["horizon"] == 100 and rec["dense_prefix"] == 4
    assert rec["lr"] == 3e-4 and rec["indexer_lr"] == 1e-3
    assert schedule_record(wsd(lr_horizon=400))["horizon"] == 400


def test_unchanged_schedule_says_nothing():
    c = wsd()
    assert schedule_change(schedule_record(c), c, 50) is None
    assert schedule_change(None, c, 50) is None  # a checkpoint from before schedule records
    assert schedule_change({"kind": "wsd"}, c, 50) is None  # or a partial one
    cos = TrainConfig(steps=100)
    # decay_fraction means nothing to a cosine; extending a run that is already over neither
    assert (
        schedule_change(schedule_record(cos), TrainConfig(steps=100, decay_fraction=0.5), 5) is None
    )
    assert schedule_change(schedule_record(cos), cos, 100) is None


def test_cosine_steps_raised_jumps_and_says_how_to_keep_the_curve():
    old = TrainConfig(steps=200, warmup_steps=20, lr=3e-4)
    new = TrainConfig(steps=400, warmup_steps=20, lr=3e-4)
    msg = schedule_change(schedule_record(old), new, 120)
    assert msg is not None and "\n" not in msg
    assert msg.startswith(
        "lr schedule changed on resume at step 120: horizon 200 -> 400 (train.steps)"
    )
    was, now = 3e-4 * lr_factor(120, old), 3e-4 * lr_factor(120, new)
    assert f"lr {was:.1e} -> {now:.1e} at step 121 (a jump)" in msg
    assert msg.endswith("set train.lr_horizon=200 to keep the old curve")
    # Following the advice keeps the old curve, to its end and past it (the floor).
    kept = TrainConfig(steps=400, warmup_steps=20, lr=3e-4, lr_horizon=200)
    assert schedule_change(schedule_record(old), kept, 120) is None


def test_wsd_extended_in_its_stable_phase_has_no_jump():
    old, new = wsd(), wsd(steps=200)  # the old decay began at step 81 (1-based)
    msg = schedule_change(schedule_record(old), new, 50)
    assert msg is not None and "\n" not in msg
    assert "horizon 100 -> 200 (train.steps)" in msg
    assert "no jump" in msg and "the curves part at step 81" in msg
    late = schedule_change(schedule_record(old), new, 90)  # already decaying: back up to 1
    assert late is not None and "(a jump)" in late
    # An explicit horizon is named as the source.
    explicit = schedule_change(schedule_record(old), wsd(steps=200, lr_horizon=300), 50)
    assert explicit is not None and "horizon 100 -> 300 (train.lr_horizon)" in explicit


def test_lr_changed():
    msg = schedule_change(schedule_record(wsd(lr=3e-4)), wsd(lr=1e-4), 50)
    assert msg is not None
    assert (
        "train.lr 3.0e-04 -> 1.0e-04" in msg and "lr 3.0e-04 -> 1.0e-04 at step 51 (a jump)" in msg
    )
    assert "horizon" not in msg and "lr_horizon" not in msg
    only_indexer = schedule_change(schedule_record(wsd()), wsd(indexer_lr=1e-3), 50)
    assert only_indexer is not None and "indexer lr 3.0e-03 -> 1.0e-03" in only_indexer


def test_other_optimizer_settings_changed_on_resume_are_returned_to_be_said():
    """A resume applied a new train.beta1 / weight_decay silently (and config.toml, rewritten,
    no longer held the old values)."""
    import torch

    from wanka.train.optim import apply_hyperparameters, build_optimizer

    inner = torch.nn.ModuleDict({"w": torch.nn.Linear(4, 4), "indexer": torch.nn.Linear(4, 4)})
    opt = build_optimizer(torch.nn.ModuleDict({"m": inner}), TrainConfig())
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay", "indexer"]
    assert apply_hyperparameters(opt, TrainConfig()) == []
    assert apply_hyperparameters(opt, TrainConfig(lr=1e-2)) == []  # the schedule says that one
    got = apply_hyperparameters(opt, TrainConfig(lr=1e-2, beta1=0.8, weight_decay=0.01))
    base = TrainConfig()
    assert got == [f"train.weight_decay {base.weight_decay:g} -> 0.01",
                   f"train.beta1 {base.beta1:g} -> 0.8"]  # fmt: skip
    assert apply_hyperparameters(opt, TrainConfig(lr=1e-2, beta1=0.8, weight_decay=0.01)) == []
