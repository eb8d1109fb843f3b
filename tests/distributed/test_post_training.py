"""Post-training on gloo ranks: 2 data-parallel ranks compute what 1 rank holding the whole
global batch computes (distillation off-policy, so the completions are fixed), teachers
sharded like the student; and a student distilled from itself feels no divergence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.helpers import spawn, spawn_in_turn, spawn_jobs

TINY = ["data.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "parallel.ep=1",
        "train.eval_every=1000", "data.val_batches=1", "run.tensorboard=false",
        "resilience.snapshot_every=0", "model.index_topk=16", "model.n_layers=3",
        "model.index_share_every=2"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset) -> Path:
    """A base (student) and a teacher (trained longer, from another seed)."""
    tmp = tmp_path_factory.mktemp("post")
    tiny = [*TINY, f'data.path="{dataset}"']
    spawn_jobs(1, [*tiny, "train.steps=4", "checkpoint.every=4", f"run.dir={tmp / 'base'}"],
               [*tiny, "train.steps=8", "checkpoint.every=8", "train.seed=3",
                f"run.dir={tmp / 'teacher'}"])  # fmt: skip
    return tmp


def post_job(command: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    from wanka.config import load_config
    from wanka.post import distill, rl

    (distill if command == "distill" else rl).main(load_config(None, overrides))
    dist.destroy_process_group()


def _rows(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _distill(runs: Path, name: str, *extra: str) -> list[str]:
    return ["train.steps=2", "train.lr=1e-3", "train.warmup_steps=1", "checkpoint.every=100",
            "run.tensorboard=false", f"post.init={runs / 'base'}", "post.completion_tokens=12",
            "post.prompt_chars=40", "post.eval_prompts=2", f"run.dir={runs / name}",
            f"post.teachers=code={runs / 'teacher'},prose={runs / 'base'}", *extra]  # fmt: skip


def test_two_ranks_distill_exactly_as_one(runs):
    off_policy = "post.on_policy_fraction=0"
    # Expert parallel too (ep2): the student's and the teachers' experts split over 2 ranks,
    # rows of different lengths on each, teachers run on a dummy row where a rank has none of a
    # domain. Both 2-rank jobs in one spawn, one after the other.
    spawn_in_turn(2, (post_job, "distill", _distill(runs, "dp2", off_policy, "post.prompts_per_step=2")),
                  (post_job, "distill", _distill(runs, "ep2", off_policy, "post.prompts_per_step=2",
                                                 "parallel.ep=2")))  # fmt: skip
    spawn(1, post_job, "distill", _distill(runs, "dp1", off_policy, "post.prompts_per_step=4"))
    two, one = _rows(runs / "dp2", "train"), _rows(runs / "dp1", "train")
    ep = _rows(runs / "ep2", "train")
    assert [r["completion_tokens"] for r in two] == [r["completion_tokens"] for r in one]
    for a, b, c in zip(two, one, ep):  # step 2 runs on weights step 1 updated: so did that
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert c["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert c["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert two[0]["loss"] > 1e-3  # the code teacher differs from the student
    # The prose teacher is the student itself: zero divergence, to rounding, on step 1.
    assert abs(one[0]["divergence/prose"]) < 1e-5 < one[0]["divergence/code"]
    ev2, ev1 = _rows(runs / "dp2", "eval"), _rows(runs / "dp1", "eval")
    assert ev2[-1]["val_loss/code"] == pytest.approx(ev1[-1]["val_loss/code"], rel=1e-5)
    # Held-out reverse KL on the student's own samples (each rank samples with its own seed,
    # so only its structure is compared across world sizes): zero against itself as teacher.
    for ev in (ev1, ev2):
        assert ev[0]["step"] == 0
        assert abs(ev[0]["val_reverse_kl/prose"]) < 1e-5 < ev[0]["val_reverse_kl/code"]
        assert ev[-1]["val_reverse_kl/prose"] >= 0 and ev[-1]["val_reverse_kl/code"] > 0


def test_on_policy_distillation_and_rl_run_on_two_ranks_and_resume(runs):
    run = runs / "onpolicy"
    spawn(2, post_job, "distill", _distill(runs, "onpolicy", "post.prompts_per_step=2",
                                           "checkpoint.every=2"))  # fmt: skip
    rl = ["train.steps=2", "train.lr=1e-3", f"post.init={runs / 'base'}", "run.tensorboard=false",
          "post.completion_tokens=12", "post.prompt_chars=60", "post.eval_prompts=2",
          "post.samples_per_prompt=3", "post.prompts_per_step=1", f"run.dir={runs / 'rl'}",
          "post.updates_per_batch=2", "post.clip_eps=0.01"]  # fmt: skip
    # The resume in a fresh spawn, as a restarted job would run; the RL job after it, in turn.
    spawn_in_turn(2, (post_job, "distill", _distill(runs, "onpolicy", "post.prompts_per_step=2",
                                                    "train.steps=3")),  # resumes from step 2
                  (post_job, "rl", rl))  # fmt: skip
    steps = [r["step"] for r in _rows(run, "train")]
    assert steps == [1, 2, 3] and all(r["on_policy"] == 1.0 for r in _rows(run, "train"))
    [first, second] = _rows(runs / "rl", "train")
    assert 0.0 <= first["reward"] <= 1.0 and first["completion_tokens"] > 0
    # The logged values are the second update's: its ratio is against the sampling policy,
    # which the first update moved away from (a ratio of exactly 1 would mean no clip at all).
    for row in (first, second):
        assert row["ratio_mean"] != 1.0 and row["kl_mean"] > 0.0
    assert [r["step"] for r in _rows(runs / "rl", "eval")] == [0, 2]


def _rollout_matches_policy() -> None:
    import torch
    import torch.distributed as dist

    from wanka.config.schema import ModelConfig, ParallelConfig
    from wanka.distributed.parallel_dims import ParallelDims
    from wanka.post.engine import Rollout, build_sharded

    dist.init_process_group("gloo")
    dims = ParallelDims.from_config(ParallelConfig(ep=2), 2)
    dims.build_meshes("cpu")
    cfg = ModelConfig(n_layers=2, index_topk=8)
    policy = build_sharded(cfg, dims, torch.device("cpu"), seed=1)
    rollout = Rollout(cfg, torch.device("cpu"))
    rollout.sync(policy)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, 24)
    docs, labels = torch.zeros_like(tokens), torch.full_like(tokens, -100)
    with torch.no_grad():
        want = policy(tokens, pos, docs, labels, return_logits=True).logits
        got = rollout.model(tokens, pos, docs, labels, return_logits=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the copy follows the policy, not a snapshot of it
        for p in policy.parameters():
            p.add_(0.01)
    rollout.sync(policy)
    with torch.no_grad():
        want = policy(tokens, pos, docs, labels, return_logits=True).logits
        got = rollout.model(tokens, pos, docs, labels, return_logits=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dist.destroy_process_group()


def test_the_rollout_copy_computes_what_the_sharded_policy_does():
    """Expert-parallel over 2 ranks: every rank's unsharded copy holds all experts."""
    spawn(2, _rollout_matches_policy)
