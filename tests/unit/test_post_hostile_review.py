"""Hostile review of post-training (rewards, advantages, post.init): each test failed on the
code before its fix."""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch

from wanka.config.schema import ModelConfig
from wanka.post.losses import group_advantages
from wanka.post.prompts import TaggedPrompt
from wanka.post.rewards import load_reward
from wanka.post.rl import _rewards


def test_a_constant_offset_in_the_rewards_keeps_the_signal() -> None:
    """GRPO is shift-invariant: rewards 1e8 and 1e8 + 1 are a win and a loss. They were
    normalised in float32 (spacing 8 at 1e8), where they are equal: zero advantage, nothing
    learned, nothing said. The rewards arrive in float64 and are now normalised in it."""
    r = torch.tensor([1e8, 1e8 + 1, 1e9, 1e9 + 30, 0.0, 1e30], dtype=torch.float64)
    adv = group_advantages(r, 2)
    torch.testing.assert_close(adv.double(), torch.tensor([-1.0, 1, -1, 1, -1, 1],
                                                          dtype=torch.float64),
                               atol=1e-5, rtol=0)  # fmt: skip
    # float32 rewards still give float32 advantages (what the loss uses)
    assert group_advantages(torch.tensor([0.0, 1.0]), 2).dtype == torch.float32


class _Unreadable:
    def __float__(self) -> float:
        raise RuntimeError("cannot say")


@pytest.mark.parametrize(
    "value",
    [_Unreadable(), torch.tensor(1.0, device="meta")],
    ids=["__float__ raises", "meta tensor"],
)
def test_a_reward_value_that_cannot_be_read_is_one_line(value) -> None:
    """float() of what the function returned runs the user's code too (__float__, a tensor's
    .item()): anything it raises was a traceback, not the one line naming post.reward."""
    with pytest.raises(ValueError, match=r"post.reward='m:f' returned .* a reward must be a "
                                         r"finite number") as info:  # fmt: skip
        _rewards(lambda p, c, d: value, [TaggedPrompt("p", "code")], ["c"], "m:f")
    assert "\n" not in str(info.value)


def test_an_async_reward_is_refused_at_load(tmp_path, monkeypatch) -> None:
    """An `async def` reward passed the signature check, then every call returned a coroutine:
    the job stopped at the first step, not before any rank started."""
    (tmp_path / "hostile_async_reward.py").write_text(
        "async def reward(prompt, completion, domain):\n    return 1.0\n\n\n"
        "class Scorer:\n    async def __call__(self, prompt, completion, domain):\n"
        "        return 1.0\n\n\nscorer = Scorer()\n\n\n"
        "def gen(prompt, completion, domain):\n    yield 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"reward 'hostile_async_reward:reward': .*async"):
            load_reward("hostile_async_reward:reward")
        with pytest.raises(ValueError, match=r"hostile_async_reward.scorer is an async function"):
            load_reward("hostile_async_reward:scorer")
        with pytest.raises(ValueError, match=r"hostile_async_reward.gen is a generator function"):
            load_reward("hostile_async_reward:gen")
        assert load_reward("builtins:max") is max  # no signature: still taken as it is
    finally:
        sys.modules.pop("hostile_async_reward", None)


def test_a_coroutine_returned_by_a_reward_is_one_line_and_closed() -> None:
    async def later() -> float:
        return 1.0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"returned <coroutine.*await it"):
            _rewards(lambda p, c, d: later(), [TaggedPrompt("p", "code")], ["c"], "m:f")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_post_init_is_read_from_one_checkpoint_per_job(tmp_path, monkeypatch) -> None:
    """post.init is read more than once in a job (rl: the policy, then the KL reference; and
    on every rank): each read took the newest checkpoint *then*. A post.init still training
    (or pruning) between the reads gave a policy and a reference from different steps (or
    ranks holding shards of different checkpoints), silently. The first choice now holds for
    the whole job; the next job chooses afresh."""
    from wanka.post import engine

    ckpts = tmp_path / "base" / "checkpoints"
    newest = iter([ckpts / "step-00000002", ckpts / "step-00000004", ckpts / "step-00000006"])
    monkeypatch.setattr(engine, "find_checkpoint", lambda run_dir: next(newest))
    monkeypatch.setattr(engine.dcp, "load", lambda state, checkpoint_id: None)
    model = torch.nn.Linear(2, 2)
    model.cfg = ModelConfig()
    base = tmp_path / "base"
    policy = engine.load_weights(model, base, "post.init")
    reference = engine.load_weights(model, str(base) + "/", "post.init (the KL reference)")
    assert policy == reference == ckpts / "step-00000002"
    engine.forget_checkpoints()  # what setup() does: a new job
    assert engine.load_weights(model, base, "post.init") == ckpts / "step-00000004"
    engine.forget_checkpoints()


def test_a_post_init_without_a_sound_checkpoint_is_still_one_line(tmp_path) -> None:
    from wanka.post import engine

    model = torch.nn.Linear(2, 2)
    model.cfg = ModelConfig()
    with pytest.raises(ValueError, match=r"post.init: .* has no complete checkpoint"):
        engine.load_weights(model, tmp_path / "empty", "post.init")
    engine.forget_checkpoints()


def test_a_prompts_line_json_cannot_read_names_its_file_and_line(tmp_path) -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of over 4300
    digits, in any key, even one that is ignored: the refusal lacked file:line."""
    from wanka.post.prompts import read_prompts_jsonl

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "domain": "code"}\n{"prompt": "b", "domain": "code", '
                    '"id": 1' + "0" * 5000 + "}\n")  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{path}:2: not readable JSON \(Exceeds the limit"):
        read_prompts_jsonl(path)


def test_a_reward_that_turns_grad_off_does_not_stop_training(tmp_path, monkeypatch) -> None:
    """A scoring module that calls torch.set_grad_enabled(False), as it loads or as it scores
    (inference scripts do), left the policy's next forward without a graph: `wanka rl` died at
    the first backward with a RuntimeError traceback. The grad mode is kept as it was."""
    (tmp_path / "hostile_nograd_reward.py").write_text(
        "import torch\n\ntorch.set_grad_enabled(False)\n\n\n"
        "def reward(prompt, completion, domain):\n"
        "    torch.set_grad_enabled(False)\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert torch.is_grad_enabled()
    try:
        fn = load_reward("hostile_nograd_reward:reward")
        assert torch.is_grad_enabled(), "importing the reward's module turned grad off"
        _rewards(fn, [TaggedPrompt("p", "code")] * 2, ["c", "d"], "m:f")
        assert torch.is_grad_enabled(), "calling the reward turned grad off"
        with torch.no_grad():  # the held-out reward runs without grad: kept so
            _rewards(fn, [TaggedPrompt("p", "code")], ["c"], "m:f")
            assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
        sys.modules.pop("hostile_nograd_reward", None)


def test_a_reward_that_changes_directory_does_not_move_the_checkpoints(
    tmp_path, monkeypatch
) -> None:
    """Code rewards often run the completion in a sandbox folder and chdir there (as its module
    loads, or per call). A relative run.dir then resolved under the sandbox: `wanka rl` wrote
    its checkpoints there (seen: runs/rl/checkpoints under the reward's folder, metrics in the
    real run.dir), and a rerun found none and started over. The working directory is put back
    after the import and after every call."""
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    (tmp_path / "hostile_chdir_reward.py").write_text(
        f"import os\n\nos.chdir({str(sandbox)!r})\n\n\n"
        "def reward(prompt, completion, domain):\n"
        f"    os.chdir({str(sandbox)!r})\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        fn = load_reward("hostile_chdir_reward:reward")
        assert Path.cwd() == tmp_path, "importing the reward's module moved the job"
        _rewards(fn, [TaggedPrompt("p", "code")] * 2, ["c", "d"], "m:f")
        assert Path.cwd() == tmp_path, "calling the reward moved the job"
    finally:
        sys.modules.pop("hostile_chdir_reward", None)
