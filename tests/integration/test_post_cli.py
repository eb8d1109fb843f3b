"""`wanka distill` / `wanka rl` as a user runs them: bad input is refused in one line before
any rank starts; `wanka rl` trains with a user's own reward function."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from .helpers import wanka

TINY = ["data.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "parallel.ep=1",
        "train.eval_every=1000", "data.val_batches=1", "run.tensorboard=false",
        "resilience.supervise=false", "resilience.snapshot_every=0", "model.index_topk=16",
        "model.n_layers=2", "train.steps=2", "checkpoint.every=2"]  # fmt: skip


def sets(*items: str) -> list[str]:
    return sum((["--set", s] for s in items), [])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("postcli")
    r = wanka("train", "configs/demo.toml", "--nproc", "1", *sets(*TINY, f"run.dir={tmp / 'base'}"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "base"


@pytest.mark.parametrize(
    "command, overrides, says",
    [
        ("distill", ["post.init="], "post.init is empty"),
        ("distill", ["post.teachers=code"], "is not DOMAIN=RUN_DIR"),
        ("distill", ["post.teachers=code=a,code=b"], "names domain 'code' twice"),
        ("distill", ["post.estimator=sampled", "post.temperature=0.7"], "temperature 1"),
        ("distill", ["post.estimator=sampled", "post.divergence=forward_kl"], "reverse KL only"),
        ("rl", ["post.samples_per_prompt=1"], "use 2 or more"),
        ("rl", ["post.reward=no_such_module:fn"], "no_such_module"),
        ("rl", ["post.init=/nonexistent/run"], "not a run directory"),
        ("rl", ["post.divergence=kl"], "post.divergence"),
        ("distill", ["post.prompts_per_step=0"], "post.prompts_per_step=0"),
        ("rl", ["post.completion_tokens=0"], "post.completion_tokens=0"),
        ("rl", ["checkpoint.every=0"], "checkpoint.every=0"),
        ("distill", ["post.top_p=0"], "post.top_p=0"),
        ("distill", ["post.temperature=0"], "must be > 0"),
        ("rl", ["post.temperature=0.7"], "temperature 1"),
        ("rl", ["post.updates_per_batch=0"], "post.updates_per_batch=0"),
        ("rl", ["parallel.ep=3"], "n_experts"),  # judged against post.init's model (8 experts)
        ("distill", ["parallel.cp=2"], "parallel.cp=1"),
    ],
)
def test_bad_post_training_input_is_one_line(command, overrides, says, tmp_path, capsys):
    from wanka.cli import main  # in-process: the refusal comes before any rank or torchrun
    from wanka.config.loader import dump_toml, load_config

    run = tmp_path / "run"  # looks like a run directory: the checks get past post.init
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(load_config(None)))
    given = [f"run.dir={tmp_path / 'out'}", f"post.init={run}", *overrides]
    if command == "distill" and not any(o.startswith("post.teachers") for o in overrides):
        given.append(f"post.teachers=code={run},prose={run}")
    assert main([command, f"configs/{command}.toml", *sets(*given)]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"wanka {command}: ") and says in lines[0], lines
    assert not (tmp_path / "out").exists()  # nothing written
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ


def test_rl_with_a_user_reward_function(base, tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def quarter(prompt, completion, domain):\n"
        "    assert domain in ('code', 'prose') and isinstance(completion, str)\n"
        "    return 0.25\n"
    )
    out = tmp_path / "rl"
    given = [f"run.dir={out}", f"post.init={base}", "post.reward=my_reward:quarter", "train.steps=1",
             "post.completion_tokens=8", "post.eval_prompts=1", "post.samples_per_prompt=2",
             "post.prompts_per_step=1", "run.tensorboard=false"]  # fmt: skip
    r = wanka("rl", "configs/rl.toml", *sets(*given), env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["command"] == "rl" and result["val_reward"] == 0.25  # the user's function
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    [train] = [x for x in rows if x["kind"] == "train"]
    assert train["reward"] == 0.25 and train["completion_tokens"] > 0
    assert train["groups_with_a_reward"] == 1.0 and train["kl_mean"] == 0.0  # equal rewards
    assert (out / "checkpoints" / "step-00000001").is_dir()


def test_supervised_rl_recovers_from_a_killed_rank(base, tmp_path):
    """The resilience layer as for `wanka train`: a rank killed mid-job is detected by the
    supervisor and the job restarts from its last checkpoint and finishes."""
    out = tmp_path / "sup"
    given = [f"run.dir={out}", f"post.init={base}", "train.steps=3", "checkpoint.every=1",
             "post.completion_tokens=8", "post.eval_prompts=1", "post.samples_per_prompt=2",
             "post.prompts_per_step=1", "run.tensorboard=false", "resilience.snapshot_every=0",
             f"resilience.ledger={tmp_path / 'faults.sqlite'}", "resilience.hang_floor_s=30"]  # fmt: skip
    r = wanka("rl", "configs/rl.toml", "--nproc", "2", "--chaos", "kill@step=2,rank=1",
              *sets(*given), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "process_crash" in r.stderr and "restart 1" in r.stderr, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["kind"] == "train"][-1] == 3
    assert (out / "checkpoints" / "step-00000003").is_dir()
