"""Hostile review of post-training, second round (resume records, teachers, the held-out split,
the RL signal metric, the recorded origin): each test failed on the code before its fix."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wanka.config.loader import dump_toml, load_config
from wanka.post import engine
from wanka.post.job import _prompts, _refuse_another_origin
from wanka.post.origin import origin, origin_change
from wanka.post.prompts import TaggedPrompt, split_jsonl_prompts
from wanka.train.checkpoint import MARKER


def cfg(*sets: str):
    return load_config(None, list(sets), check=False)


def run_dir(path: Path, step: int = 2, weights: str = "a", sound: bool = True) -> Path:
    """A run directory (config.toml) with a complete checkpoint of `step` whose one file
    holds `weights`; `sound=False`: the file is missing (a damaged checkpoint)."""
    ck = path / "checkpoints" / f"step-{step:08d}"
    ck.mkdir(parents=True)
    data = weights.encode()
    if sound:
        (ck / "__0_0.distcp").write_bytes(data)
    files = {"__0_0.distcp": [len(data), hashlib.sha256(data).hexdigest()]}
    (ck / MARKER).write_text(json.dumps({"step": step, "time": 0.0, "files": files}))
    if not (path / "config.toml").exists():
        (path / "config.toml").write_text(dump_toml(load_config(None)))
    return path


# 1. Settings that change what a resumed job computes are recorded; the others stay free.


def test_a_resume_with_another_group_size_or_split_is_refused_in_one_line(tmp_path) -> None:
    """post.samples_per_prompt (the GRPO group: each reward's baseline) and post.eval_prompts
    (which prompts are held out, so which are trained on) were not recorded: a resume with
    another value went on silently, mixing two objectives (or two splits) in one run."""
    base = run_dir(tmp_path / "base")
    common = [f"post.init={base}", "post.samples_per_prompt=4"]
    saved = json.dumps(origin(cfg(*common), "rl", ["code"]))

    def change(*sets: str, command: str = "rl", record: str = saved) -> str | None:
        return origin_change(record, origin(cfg(*common, *sets), command, ["code"]))

    assert change() is None
    assert change("post.samples_per_prompt=8") == (
        "post.samples_per_prompt changed from 4 to 8 since the run started: use a new run.dir, "
        "or set it back"
    )
    assert change("post.eval_prompts=4") == (
        "post.eval_prompts changed from 16 to 4 since the run started: use a new run.dir, or "
        "set it back"
    )
    # Safe to change on resume: steps, intervals, batch size, sampling length, the clip.
    free = ["train.steps=900", "train.log_every=5", "train.eval_every=7", "train.lr=1e-3",
            "post.prompts_per_step=8", "post.completion_tokens=96", "post.clip_eps=0.3",
            "post.updates_per_batch=2", "checkpoint.every=3"]  # fmt: skip
    for setting in free:
        assert change(setting) is None, setting
    # The split is every command's; the group size only rl's (sft never reads it).
    sft = json.dumps(origin(cfg(*common), "sft", ["code"]))
    assert "post.eval_prompts changed" in change("post.eval_prompts=4", command="sft", record=sft)
    assert change("post.samples_per_prompt=8", command="sft", record=sft) is None
    # A checkpoint recorded before these settings were resumes as before.
    older = {k: v for k, v in json.loads(saved).items()
             if k not in ("post.samples_per_prompt", "post.eval_prompts")}  # fmt: skip
    assert change("post.samples_per_prompt=8", "post.eval_prompts=4",
                  record=json.dumps(older)) is None  # fmt: skip
    # What the job does with it: one line, raised before anything in run.dir changes.
    job = SimpleNamespace(origin=origin(cfg(*common, "post.samples_per_prompt=8"), "rl", ["code"]))
    with pytest.raises(ValueError, match=r"^post.samples_per_prompt changed from 4 to 8") as info:
        _refuse_another_origin(job, {"post_origin": saved})
    assert "\n" not in str(info.value)


# 2. A teacher that is the student's own starting checkpoint.


@pytest.fixture
def launcher(monkeypatch):
    """The checks as the launcher runs them (not inside torchrun)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def _distill(tmp_path: Path, init: Path, teachers: str):
    from wanka.post.distill import check_distill

    check_distill(cfg(f"run.dir={tmp_path / 'out'}", f"post.init={init}",
                      f"post.teachers={teachers}"))  # fmt: skip


def test_distilling_from_post_init_itself_is_refused(tmp_path, launcher, capsys) -> None:
    """A teacher that is post.init's checkpoint starts equal to the student: every divergence
    and its gradient are 0, and the job ran its steps learning nothing, silently."""
    base = run_dir(tmp_path / "base")
    shutil.copytree(base, tmp_path / "copy")  # a copy is the same checkpoint
    for teachers in (f"code={base},prose={base}", f"code={base}/,prose={tmp_path / 'copy'}"):
        with pytest.raises(ValueError, match=r"^post.teachers: every teacher is post.init's own "
                                             r"checkpoint .*learns nothing") as info:  # fmt: skip
            _distill(tmp_path, base, teachers)
        assert "\n" not in str(info.value)
    # Some teachers: a use (it keeps the student where it is on that domain), said once.
    other = run_dir(tmp_path / "other", weights="b")
    capsys.readouterr()
    _distill(tmp_path, base, f"code={other},prose={base}")
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("wanka distill: note: the teacher for 'prose' is "
                                               "post.init's own checkpoint"), err  # fmt: skip
    _distill(tmp_path, base, f"code={other},prose={other}")
    assert capsys.readouterr().err == ""


# 3. The held-out split.


def test_a_repeated_prompt_is_never_both_trained_on_and_held_out(tmp_path, caplog) -> None:
    """The last line of each domain was held out by position: a prompt repeated earlier in
    the file was trained on too, so the held-out eval measured trained prompts."""
    rows = [("p", "a"), ("q", "a"), ("r", "a"), ("p", "a"), ("q", "a"), ("x", "b"), ("y", "b"),
            ("y", "b"), ("r", "b")]  # fmt: skip
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "domain": d}) + "\n" for t, d in rows))
    train, held = split_jsonl_prompts(path, None, 1)
    assert held == [TaggedPrompt("q", "a"), TaggedPrompt("r", "b")]
    # Every copy of a held-out text is out of training, its own domain's ("q") and another's
    # ("r", held out for "b"); repeats of a training prompt are kept, as the file weights them.
    assert [(x.text, x.domain) for x in train] == [("p", "a"), ("p", "a"), ("x", "b"),
                                                   ("y", "b"), ("y", "b")]  # fmt: skip
    assert split_jsonl_prompts(path, None, 1) == (train, held)  # deterministic
    # Two held out of "a": the distinct texts that come last (r, then p and q re-appear).
    assert [x.text for x in split_jsonl_prompts(path, {"a"}, 2)[1]] == ["p", "q"]
    with pytest.raises(ValueError, match=r"domain 'a' has 5 prompts \(3 distinct\), "
                                         r"post.eval_prompts=3 are held out"):  # fmt: skip
        split_jsonl_prompts(path, None, 3)
    few = tmp_path / "few.jsonl"  # "a" keeps only "s", which "b" holds out
    few.write_text("".join(json.dumps({"prompt": t, "domain": d}) + "\n"
                           for t, d in [("s", "a"), ("t", "a"), ("u", "b"), ("s", "b")]))  # fmt: skip
    with pytest.raises(ValueError, match=r"every prompt of domain 'a' is also a held-out prompt"):
        split_jsonl_prompts(few, None, 1)
    # The sizes the job reports are those it trains and evaluates on, with the lines left out.
    with caplog.at_level(logging.WARNING, logger="wanka.post"):
        got = _prompts(cfg(f"post.prompts={path}", "post.eval_prompts=1"), 1, "sft")
    assert got == (train, held)
    assert f"{path}: 2 line(s) repeat a held-out prompt: not trained on (5 train / 2 held-out " \
           "prompts)" in caplog.text  # fmt: skip


def test_builtin_training_prompts_never_repeat_a_held_out_one() -> None:
    """The built-in train and val documents share text (pydoc topics quote each other): with
    seed 0, 4 of 128 held-out prompts were also training prompts. Such a draw is passed over,
    so the pool keeps its size (the counts said stay true)."""
    c = cfg("post.prompt_seed=0", "post.eval_prompts=64", "train.steps=500",
            "post.prompts_per_step=2")  # fmt: skip
    train, val = _prompts(c, 1, "distill")
    assert len(val) == 2 * 64 and len(train) == 2 * 500
    assert not {x.text for x in train} & {x.text for x in val}
    assert len({x.text for x in train}) == len(train)


# 4. The RL metric of learning signal.


def test_groups_with_signal_counts_the_groups_grpo_learns_from() -> None:
    """groups_with_a_reward (max > 0) was drawn by `wanka report` as the share of groups with a
    learning signal: a constant reward of 0.25 read 1.0 (every group "rewarded") while every
    advantage was 0; a group of all successes counts there too, and negative rewards never."""
    from wanka.post.losses import group_advantages
    from wanka.post.rl import groups_with_signal

    r = torch.tensor([1, 1, 0, 0, 0, 1, 0.25, 0.25, -1, -2, -3, -3], dtype=torch.float64)
    assert groups_with_signal(r, 2) == 2  # (0, 1) and (-1, -2)
    moving = (group_advantages(r, 2).view(-1, 2) != 0).any(dim=1)
    assert int(moving.sum()) == groups_with_signal(r, 2)
    assert groups_with_signal(torch.full((8,), 0.25, dtype=torch.float64), 4) == 0
    assert groups_with_signal(torch.tensor([0.0, 0, 0, 1e-3]), 4) == 1


def test_the_report_plots_the_signal_share() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wanka.post.report import _rl_panels, is_post_run

    def twin_label(rows: list[dict]) -> str:
        fig, axes = plt.subplots(3)
        _rl_panels(axes, rows, [])
        labels = [ax.get_ylabel() for ax in fig.axes[3:]]
        plt.close(fig)
        return labels[0]

    now = [{"step": s, "reward": 0.5, "groups_with_signal": 0.25, "groups_with_a_reward": 1.0}
           for s in (1, 2)]  # fmt: skip
    assert twin_label(now) == "groups with signal"
    old = [{"step": s, "reward": 0.5, "groups_with_a_reward": 1.0} for s in (1, 2)]
    assert twin_label(old) == "groups with a reward"  # runs from before the metric
    assert is_post_run([{"step": 1, "groups_with_signal": 0.5}], [], []) == "rl"


# 5. The recorded origin names the checkpoint the job loads.


def test_the_origin_names_the_checkpoint_the_job_loads(tmp_path, monkeypatch) -> None:
    """The record was made from the newest *complete* checkpoint, before the loads chose the
    newest *sound* one: with a damaged newest checkpoint (or one saved in between by a
    post.init still training) the record named step 4 while step 2 was loaded, and a resume
    was then compared with weights the run never had."""
    base = run_dir(tmp_path / "base", step=2, weights="a")
    run_dir(base, step=4, weights="b", sound=False)  # complete, but a file is missing
    engine.forget_checkpoints()
    try:
        record = origin(cfg(f"post.init={base}"), "rl", ["code"], engine.chosen_checkpoint)
        monkeypatch.setattr(engine.dcp, "load", lambda state, checkpoint_id: None)
        model = torch.nn.Linear(2, 2)
        model.cfg = load_config(None).model
        loaded = engine.load_weights(model, base, "post.init (the KL reference)")
        assert loaded.name == "step-00000002"
        assert record["post.init"][0] == f"{base} (step-00000002)"
        # A checkpoint saved after the choice changes neither the record nor the load.
        run_dir(base, step=6, weights="c")
        assert origin(cfg(f"post.init={base}"), "rl", ["code"], engine.chosen_checkpoint) == record
        assert engine.load_weights(model, base, "post.init").name == "step-00000002"
    finally:
        engine.forget_checkpoints()
