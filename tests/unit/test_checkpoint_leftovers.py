"""What a new job does with a killed job's checkpoint leftovers: `.partial-` directories are
removed (at start, under the run lock), a checkpoint flagged corrupt is never overwritten (set
aside when its step is saved again), and a run whose every checkpoint is damaged says so in one
line."""

import logging

import torch


def test_partial_dirs_are_removed(tmp_path):
    from wanka.train.checkpoint import remove_partials

    (tmp_path / ".partial-step-00000008" / "x").mkdir(parents=True)
    (tmp_path / "step-00000004").mkdir()
    assert [p.name for p in remove_partials(tmp_path)] == [".partial-step-00000008"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]
    assert remove_partials(tmp_path / "absent") == []


def _checkpointer(root, keep=2):
    from wanka.train.checkpoint import Checkpointer

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpointer(root, model, opt, keep=keep, async_save=False, is_main=True)


def test_a_checkpoint_flagged_corrupt_is_never_overwritten(tmp_path, caplog):
    from wanka.resilience.chaos import damage_latest_checkpoint
    from wanka.train.checkpoint import CORRUPT, complete_checkpoints, verify

    ck = _checkpointer(tmp_path, keep=1)
    ck.save(1, {})
    ck.save(2, {})
    assert damage_latest_checkpoint(tmp_path, "corrupt_ckpt")
    assert ck.latest_valid() is None  # keep=1: step 1 is gone, step 2 damaged and flagged
    flagged = (tmp_path / "step-00000002" / CORRUPT).read_text()
    with caplog.at_level(logging.WARNING, logger="wanka.checkpoint"):
        ck.save(2, {})  # the resumed job reaches step 2 again
        ck.save(3, {})  # keep=1 prunes step 2, never the damaged copy
    [aside] = tmp_path.glob("step-00000002.corrupt-*")
    assert (aside / CORRUPT).read_text() == flagged and verify(aside) is not None
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000003"]
    [msg] = [r.getMessage() for r in caplog.records if "flagged corrupt" in r.getMessage()]
    assert msg == (f"checkpoint {tmp_path / 'step-00000002'} was flagged corrupt; moved to "
                   f"{aside.name} (kept for inspection) to save step 2")  # fmt: skip


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "wanka.checkpoint"]


def test_every_checkpoint_damaged_is_said_in_one_line(tmp_path, caplog):
    from wanka.resilience.chaos import damage_latest_checkpoint

    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    damage_latest_checkpoint(tmp_path, "truncate_ckpt")
    ck.save(2, {})
    damage_latest_checkpoint(tmp_path, "corrupt_ckpt")
    with caplog.at_level(logging.INFO, logger="wanka.checkpoint"):
        assert ck.latest_valid() is None
        ck.say_none_usable()
    assert _said(caplog) == [
        f"no usable checkpoint in {tmp_path} (2 damaged, kept for inspection); starting from step 0"
    ]
    assert len(ck.skipped) == 2  # each still reported as a timeline fault by the trainer
    # A later start sees the flagged ones (no longer candidates) and says the same.
    again = _checkpointer(tmp_path)
    with caplog.at_level(logging.INFO, logger="wanka.checkpoint"):
        caplog.clear()
        assert again.latest_valid() is None
        again.say_none_usable()
    assert _said(caplog) == [
        f"no usable checkpoint in {tmp_path} (2 damaged, kept for inspection); starting from step 0"
    ]
    fresh = _checkpointer(tmp_path / "empty")
    assert fresh.latest_valid() is None
    fresh.say_none_usable()  # nothing there at all: nothing to say
    assert len(_said(caplog)) == 1
