"""Resuming a post-training run (wanka/post/origin.py, job.py): a run refuses to continue from
another post.init, teacher, reward or prompt set than it started from, and the built-in
prompts a step trains on do not depend on train.steps, so an extended run sees new prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from wanka.config.loader import load_config
from wanka.post.job import PostJob, _prompts
from wanka.post.origin import origin, origin_change
from wanka.train.checkpoint import MARKER


def run_dir(path: Path, step: int = 2, weights: str = "a") -> Path:
    """A run directory with one complete checkpoint whose manifest describes `weights`."""
    ck = path / "checkpoints" / f"step-{step:08d}"
    ck.mkdir(parents=True)
    files = {"__0_0.distcp": [3, f"sha-of-{weights}"]}
    (ck / MARKER).write_text(json.dumps({"step": step, "time": 0.0, "files": files}))
    return path


def cfg(*sets: str):
    return load_config(None, list(sets), check=False)


def record(*sets: str, command: str = "rl", used=("code",)) -> str:
    """What a checkpoint of a job with these settings holds."""
    return json.dumps(origin(cfg(*sets), command, list(used)))


def change(saved: str, *sets: str, command: str = "rl", used=("code",)) -> str | None:
    return origin_change(saved, origin(cfg(*sets), command, list(used)))


def test_a_changed_post_init_is_refused_in_one_line(tmp_path) -> None:
    base, other = run_dir(tmp_path / "base"), run_dir(tmp_path / "other", weights="b")
    saved = record(f"post.init={base}")
    assert change(saved, f"post.init={base}") is None
    msg = change(saved, f"post.init={other}")
    assert msg == (f"post.init changed from {base} (step-00000002) to {other} (step-00000002) "
                   "since the run started: use a new run.dir, or set it back")  # fmt: skip
    # A moved or copied run is the same checkpoint: accepted.
    shutil.copytree(base, tmp_path / "copy")
    assert change(saved, f"post.init={tmp_path / 'copy'}") is None
    # post.init trained on since: RL's KL reference (reloaded at every start) would move.
    run_dir(base, step=4, weights="c")
    assert "to " + f"{base} (step-00000004)" in change(saved, f"post.init={base}")


def test_a_starting_point_trained_on_meanwhile_does_not_stop_other_commands(tmp_path) -> None:
    """sft, distill and draft start from post.init once (a resume reads its own checkpoint):
    the base run saving a newer checkpoint meanwhile refused their resume (found in review).
    Another run is still refused."""
    base, other = run_dir(tmp_path / "base"), run_dir(tmp_path / "other", weights="b")
    teacher = run_dir(tmp_path / "t", weights="t")
    for command in ("sft", "distill", "draft"):
        sets = [f"post.teachers=code={teacher}"] if command == "distill" else []
        saved = record(f"post.init={base}", *sets, command=command)
        run_dir(base, step=10 + len(command), weights=command)  # base trains on
        assert change(saved, f"post.init={base}", *sets, command=command) is None, command
        assert "post.init changed" in change(saved, f"post.init={other}", *sets, command=command)


def test_the_objective_and_its_targets_are_recorded(tmp_path) -> None:
    base = run_dir(tmp_path / "base")
    t1, t2 = run_dir(tmp_path / "t1", weights="t1"), run_dir(tmp_path / "t2", weights="t2")
    common = [f"post.init={base}"]
    rl = record(*common)
    assert "post.reward changed from python_parses to python_lines" in change(
        rl, *common, "post.reward=python_lines"
    )
    assert "post.kl_coef changed from 0.04 to 0.1" in change(rl, *common, "post.kl_coef=0.1")
    assert "post.prompt_seed changed from 0 (train.seed) to 5" in change(
        rl, *common, "post.prompt_seed=5"
    )
    assert change(rl, *common, "train.lr=1e-3", "train.steps=500") is None  # not the origin
    both = ("code", "prose")
    teachers = f"post.teachers=code={t1},prose={t1}"
    distill = record(*common, teachers, command="distill", used=both)
    msg = change(distill, *common, f"post.teachers=code={t1},prose={t2}", command="distill",
                 used=both)  # fmt: skip
    assert msg.startswith(f"post.teachers changed from prose={t1} (step-00000002) to prose={t2}")
    msg = change(distill, *common, teachers, "post.divergence=jsd", command="distill", used=both)
    assert "post.divergence changed from reverse_kl to jsd" in msg
    # A spare teacher (a domain the prompts lack) is never loaded: not part of the origin.
    assert change(distill, *common, teachers + f",math={t2}", command="distill", used=both) is None
    draft = record(*common, command="draft")
    assert "post.draft_steps changed from 2 to 1" in change(draft, *common, "post.draft_steps=1",
                                                            command="draft")  # fmt: skip


def test_a_prompts_file_edited_in_place_is_another_prompt_set(tmp_path) -> None:
    base, prompts = run_dir(tmp_path / "base"), tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "domain": "code"}\n')
    sets = (f"post.init={base}", f"post.prompts={prompts}")
    saved = record(*sets, command="sft")
    assert change(saved, *sets, command="sft") is None
    prompts.write_text('{"prompt": "b", "domain": "code"}\n')
    assert change(saved, *sets, command="sft") == (
        f"post.prompts={prompts} holds other content than when the run started: use a new "
        "run.dir, or restore it"
    )


def test_a_checkpoint_without_a_record_resumes_as_before(tmp_path) -> None:
    """Checkpoints saved before records (or with fewer keys) are not refused."""
    now = origin(cfg(f"post.init={run_dir(tmp_path / 'base')}"), "rl", ["code"])
    assert origin_change(None, now) is None and origin_change("", now) is None
    assert origin_change(json.dumps({"post.reward": ["python_parses"] * 2}), now) is None


def _steps_prompts(steps: int, run_steps: int, dp: int = 2) -> list[list[str]]:
    """The prompts (all ranks) of the first `steps` steps of a run of `run_steps` steps."""
    c = cfg("post.prompts_per_step=3", f"train.steps={run_steps}", "post.prompt_chars=64",
            "post.eval_prompts=1", "post.completion_tokens=8")  # fmt: skip
    train, val = _prompts(c, dp, "distill")
    out = []
    for step in range(steps):
        row = []
        for rank in range(dp):
            job = PostJob(c, SimpleNamespace(dp=dp), None, None, None, None, None, train, val,
                          None, None, rank, rank, Path("."))  # fmt: skip
            job.drawn_in_order = True
            row += [x.text for x in job.prompts_for(step)]
        out.append(row)
    return out


def test_an_extended_run_trains_on_the_prompts_of_an_equally_long_run() -> None:
    """The pool's size follows train.steps; its order used to be a shuffle of the whole pool,
    so steps 4-6 of a 3-step run extended to 6 reused prompts of steps 1-3 and never showed
    others. Now step s gets the same prompts whatever train.steps sized the pool."""
    short, long = _steps_prompts(3, run_steps=3), _steps_prompts(6, run_steps=6)
    assert long[:3] == short
    flat = [x for row in long for x in row]
    assert len(set(flat)) == len(flat) == 6 * 2 * 3  # no prompt twice within the first pass


@pytest.mark.parametrize("k", [0, 1])
def test_jsonl_prompts_are_shuffled_every_pass(k) -> None:
    from wanka.post.job import prompt_order

    assert prompt_order(50, k, 0, drawn_in_order=False) != list(range(50))
    assert (prompt_order(50, k, 0, drawn_in_order=True) == list(range(50))) == (k == 0)


def test_a_user_reward_edited_in_place_is_another_reward(tmp_path, monkeypatch) -> None:
    """The reward was recorded by name only: an edit to a user reward's module resumed
    silently, mixing two rewards in one run's curve."""
    base, pkg = run_dir(tmp_path / "base"), tmp_path / "mods"
    pkg.mkdir()
    module = pkg / "my_reward_mod.py"
    module.write_text("def score(prompt, completion, domain):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(pkg))
    sets = (f"post.init={base}", "post.reward=my_reward_mod:score")
    saved = record(*sets)
    assert change(saved, *sets) is None
    module.write_text("def score(prompt, completion, domain):\n    return 0.5\n")
    assert change(saved, *sets) == (
        f"post.reward=my_reward_mod:score (code in {module}) holds other content than when the "
        "run started: use a new run.dir, or restore it"
    )
    # Recorded before the code was: resumes as it did. Built-ins have no code entry.
    older = json.loads(saved)
    del older["post.reward:code"]
    assert change(json.dumps(older), *sets) is None
    assert "post.reward:code" not in json.loads(record(f"post.init={base}"))
    # A module that cannot be found is left to the reward's loader to name.
    assert "post.reward:code" not in json.loads(record(f"post.init={base}",
                                                       "post.reward=no_such_mod_xyz:f"))  # fmt: skip
