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
        ("rl", ["post.kl_coef=1e30"], "post.kl_coef=1e+30 is above 100"),
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
        ("distill", ["post.domains=code,math"], "names ['math']"),
        ("sft", ["post.domains=math"], "built-in prompts have the domains"),
        ("rl", ["post.domains=prose"], "judges Python"),
        ("sft", ["post.sft_source=teachers", "post.teachers="], "post.teachers is empty"),
        ("sft", ["post.sft_source=web"], "post.sft_source"),
        ("sft", ["post.init="], "post.init is empty"),
        ("draft", ["post.speculate=0"], "post.speculate=0"),
        ("draft", ["post.draft_steps=-1"], "post.draft_steps=-1"),
        ("draft", ["post.draft_steps=65", "post.completion_tokens=64"], "post.draft_steps=65"),
        ("draft", ["post.temperature=0"], "must be > 0"),
        ("rl", ["checkpoint.init_weights=/some/run"], "set post.init instead"),
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
    assert train["groups_with_signal"] == 0.0  # ... so no group has an advantage to learn from
    assert (out / "checkpoints" / "step-00000001").is_dir()


def test_a_rank_that_exits_0_mid_job_is_a_fault_not_a_hang(base, tmp_path):
    """os._exit(0) in a user's reward: torch's agent waits for the rank's return value for
    ever; the supervisor's watch names the fault and stops the launcher (it used to hang).
    The fault is the reward's (user_code), not the node's: one retry, then it gives up, and
    the ledger counts nothing against the node."""
    from wanka.resilience.ledger import EvictionPolicy, FaultLedger

    (tmp_path / "bye.py").write_text("import os\n\ndef reward(p, c, d):\n    os._exit(0)\n")
    given = [f"run.dir={tmp_path / 'rl'}", f"post.init={base}", "post.reward=bye:reward",
             "train.steps=2", "post.completion_tokens=8", "post.eval_prompts=1",
             "post.samples_per_prompt=2", "post.prompts_per_step=1", "run.tensorboard=false",
             "resilience.supervise=true", "resilience.max_restarts=3",
             f"resilience.snapshot_dir={tmp_path / 'shm'}",
             f"resilience.ledger={tmp_path / 'faults.sqlite'}"]  # fmt: skip
    r = wanka("rl", "configs/rl.toml", *sets(*given), env={"PYTHONPATH": str(tmp_path)},
              timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "user_code (rank 0 died in the job's own code (post.reward) of step 1" in r.stderr, (
        r.stderr[-3000:]
    )
    assert "failed twice at step 1" in r.stderr and "post.reward" in r.stderr, r.stderr[-3000:]
    assert "preempted" not in r.stderr and "stopped on request" not in r.stderr
    ledger = FaultLedger(tmp_path / "faults.sqlite")
    faults = ledger.faults()
    assert [f.cause for f in faults] == ["user_code"]
    assert ledger.evaluate(faults[0].node, EvictionPolicy(1, 3600, 1)) is None


def test_supervised_rl_recovers_from_a_killed_rank_bitwise(base, tmp_path):
    """The resilience layer as for `wanka train`: a rank killed mid-job is detected by the
    supervisor, the job restarts from the in-memory snapshot (no checkpoint exists before the
    last step) and ends in exactly the state of a fault-free run."""

    def given(run: str) -> list[str]:
        return [f"run.dir={tmp_path / run}", f"post.init={base}", "train.steps=4",
                "checkpoint.every=4", "post.completion_tokens=8", "post.eval_prompts=1",
                "post.samples_per_prompt=2", "post.prompts_per_step=1", "run.tensorboard=false",
                "resilience.snapshot_every=1", f"resilience.snapshot_dir={tmp_path / 'shm'}",
                f"resilience.ledger={tmp_path / 'faults.sqlite'}", "resilience.hang_floor_s=30"]  # fmt: skip

    r = wanka("rl", "configs/rl.toml", "--nproc", "2", "--chaos", "kill@step=3,rank=1",
              *sets(*given("sup")), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "process_crash" in r.stderr and "restart 1" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("wanka rl:") >= 1 and "wanka train:" not in r.stderr  # its own name
    logs = "".join(p.read_text() for p in (tmp_path / "sup" / "logs").glob("rank*.log"))
    assert "resumed from the in-memory snapshot of step" in logs
    rows = [json.loads(x) for x in (tmp_path / "sup" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["kind"] == "train"] == [1, 2, 3, 4]  # no step twice
    # The timeline holds the post-training steps, so goodput (`wanka report`) counts them.
    from wanka.resilience.goodput import compute_goodput, read_timeline

    g = compute_goodput(read_timeline(tmp_path / "sup" / "resilience" / "timeline.jsonl"))
    assert g.steps_kept == 4 and 0.0 < g.productive_s < g.wall_s, g
    clean = wanka("rl", "configs/rl.toml", "--nproc", "2", *sets(*given("clean")), timeout=600)
    assert clean.returncode == 0, clean.stderr[-3000:]
    digest = [json.loads(x.stdout.strip().splitlines()[-1])["state_digest"] for x in (r, clean)]
    assert digest[0] == digest[1]


def test_sft_on_references_and_on_teacher_samples(base, tmp_path):
    """`wanka sft` trains on the corpus continuations of one domain (how the bench makes a
    domain teacher), then on samples of that run as a teacher (sequence-level distillation)."""
    teacher = tmp_path / "teacher"
    given = [f"post.init={base}", "train.steps=2", "checkpoint.every=2", "train.eval_every=2",
             "post.completion_tokens=8", "post.eval_prompts=2", "post.prompts_per_step=2",
             "run.tensorboard=false", "resilience.supervise=false"]  # fmt: skip
    r = wanka("sft", "configs/sft.toml", *sets(*given, f"run.dir={teacher}", "post.domains=code"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (teacher / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]
    assert all(set(k for k in x if k.startswith("val_loss/")) == {"val_loss/code"} for x in evals)
    train = [x for x in rows if x["kind"] == "train"]
    # References: the student's forward and backward (3 forward-token equivalents per token);
    # 2 prompts of 48-96 characters (byte tokens: UTF-8 may take more) + 8 tokens each.
    assert all(x["tokens_processed"] % 3 == 0 for x in train)
    assert all(3 * 2 * (48 + 8) <= x["tokens_processed"] <= 3 * 2 * (4 * 96 + 8) for x in train)
    assert all(x["completion_tokens"] == 16 for x in train)  # the reference is long enough

    out = tmp_path / "seqkd"
    r = wanka("sft", "configs/sft.toml", *sets(*given, f"run.dir={out}", "post.sft_source=teachers",
                                              f"post.teachers=code={teacher},prose={teacher}"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["kind"] == "train"]
    # The teachers' sampled tokens count too.
    assert all(x["tokens_processed"] % 3 == x["completion_tokens"] % 3 for x in train)
    evals = [x for x in rows if x["kind"] == "eval"]
    assert {"val_loss/code", "val_loss/prose"} <= set(evals[-1])
    assert (out / "checkpoints" / "step-00000002").is_dir()


def test_draft_tunes_only_the_mtp_module_and_measures_acceptance(base, tmp_path):
    """`wanka draft` on 2 ranks: the MTP module learns the frozen main model's own predictions;
    held-out evals decode speculatively and log acceptance; the run directory decodes like any
    other."""
    from wanka.infer.load import load_trained

    out = tmp_path / "draft"
    given = [f"post.init={base}", "train.steps=2", "checkpoint.every=2", "train.eval_every=2",
             "post.completion_tokens=8", "post.eval_prompts=2", "post.prompts_per_step=2",
             "run.tensorboard=false", "resilience.supervise=false", f"run.dir={out}"]  # fmt: skip
    r = wanka("draft", "configs/draft.toml", "--nproc", "2", *sets(*given))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]
    for e in evals:
        assert 0.0 <= e["val_acceptance/draft2"] <= e["val_acceptance/draft1"] <= 1.0
        assert 1.0 <= e["val_mean_acceptance_length"] <= 3.0 and e["val_mtp_kl"] >= 0.0
        assert e["val_mtp_kl_step2"] >= 0.0  # the recursive draft step is trained and scored
        assert 0.0 < e["val_distinct_4grams"] <= 1.0  # sampled text, scored beside acceptance
    train = [x for x in rows if x["kind"] == "train"]
    assert len(train) == 2 and all(x["mtp_positions"] > 0 for x in train)
    for x in train:  # post.speculate = 2 drafts: two steps trained, the loss is their sum
        assert x["mtp_kl"] > 0.0 and x["mtp_kl_step2"] > 0.0 and "mtp_kl_step3" not in x
        assert x["loss"] == pytest.approx(x["mtp_kl"] + x["mtp_kl_step2"], rel=1e-4)
    before, _, _ = load_trained(base)
    after, cfg, _ = load_trained(out)
    assert cfg.model == before.cfg
    b, a = before.state_dict(), after.state_dict()
    main = [k for k in b if not k.startswith("mtp.")]
    assert main and all(torch.equal(b[k], a[k]) for k in main), "the main model must not move"
    assert any(not torch.equal(b[k], a[k]) for k in b if k.startswith("mtp.")), "MTP unchanged"


@pytest.mark.parametrize(
    "edit", [("n_layers = 2", "n_layers = 3"), ("vocab_size = 256", "vocab_size = 300")]
)
def test_a_checkpoint_that_does_not_fit_its_config_is_one_line(base, tmp_path, edit):
    """A teacher (or post.init) whose config.toml was edited after training: DCP raises a
    CheckpointException, a BaseException that `except Exception` let through as a traceback."""
    import shutil

    from wanka.config.loader import load_config
    from wanka.models.transformer import Transformer
    from wanka.post.engine import load_weights

    teacher = tmp_path / "teacher"
    shutil.copytree(base, teacher)
    text = (teacher / "config.toml").read_text()
    assert edit[0] in text
    (teacher / "config.toml").write_text(text.replace(edit[0], edit[1]))
    with torch.device("meta"):
        model = Transformer(load_config(teacher / "config.toml").model)
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"teacher for 'code': checkpoint .* does not fit the "
                       r"model of .*config.toml \(.*(Missing key|[Ss]ize mismatch)") as info:  # fmt: skip
        load_weights(model, teacher, "teacher for 'code'")
    assert "\n" not in str(info.value)


def test_distill_refuses_a_teacher_with_nan_weights(base, tmp_path):
    """A teacher whose checkpoint holds NaN gave NaN held-out losses and skipped updates, and
    the job still ended 0: it now stops before training, in one line naming the teacher."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from wanka.train.checkpoint import write_manifest

    bad = tmp_path / "bad"
    shutil.copytree(base, bad, ignore=shutil.ignore_patterns("checkpoints"))
    [src] = sorted((base / "checkpoints").glob("step-*"))
    flat = tmp_path / "flat.pt"
    dcp_to_torch_save(src, flat)
    state = torch.load(flat, weights_only=False)
    key = next(k for k in state["model"] if k.endswith("norm.weight"))
    state["model"][key] = torch.full_like(state["model"][key], float("nan"))
    torch.save(state, flat)
    step = bad / "checkpoints" / src.name
    torch_save_to_dcp(flat, step)
    write_manifest(step, int(src.name.split("-")[1]))
    given = [f"run.dir={tmp_path / 'out'}", f"post.init={base}", "train.steps=2",
             f"post.teachers=code={bad},prose={base}", "post.completion_tokens=8",
             "post.eval_prompts=2", "post.prompts_per_step=1", "run.tensorboard=false",
             "resilience.supervise=false"]  # fmt: skip
    r = wanka("distill", "configs/distill.toml", *sets(*given))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "the teacher for 'code' gives a non-finite loss" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_resume_reports_an_lr_change_and_refuses_another_origin(base, tmp_path):
    """Extending a run (train.steps 2 -> 4, a new train.lr) moves the LR curve: said in one
    line with a marker row in metrics.jsonl, as `wanka train` does, and the config's lr is the
    one used (the checkpoint's used to win). A resume with another reward (or post.init,
    teachers, ...) is refused in one line, leaving the run as it was."""
    from wanka.config.loader import load_config
    from wanka.train.optim import Schedule

    out = tmp_path / "rl"
    given = [f"run.dir={out}", f"post.init={base}", "post.completion_tokens=8",
             "post.eval_prompts=1", "post.samples_per_prompt=2", "post.prompts_per_step=1",
             "run.tensorboard=false", "resilience.supervise=false", "checkpoint.every=2",
             "train.warmup_steps=1", "train.eval_every=1000"]  # fmt: skip
    r = wanka("rl", "configs/rl.toml", *sets(*given, "train.steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = wanka("rl", "configs/rl.toml", *sets(*given, "train.steps=4", "train.lr=2e-4"))
    assert r.returncode == 0, r.stderr[-3000:]
    [note] = [x for x in r.stderr.splitlines() if "lr schedule changed on resume" in x]
    assert "at step 2: horizon 2 -> 4 (train.steps)" in note and "train.lr" in note, note
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    [marker] = [x for x in rows if x["kind"] == "lr_schedule_change"]
    assert marker["step"] == 2 and "a jump" in marker["message"]
    cfg = load_config(out / "config.toml")
    lrs = {x["step"]: x["lr"] for x in rows if x["kind"] == "train"}
    assert lrs[3] == pytest.approx(Schedule.from_config(cfg.train).rates(2)[0], rel=1e-6)

    before = {f: (out / f).read_text() for f in ("config.toml", "metrics.jsonl")}
    r = wanka("rl", "configs/rl.toml",
              *sets(*given, "train.steps=6", "train.lr=2e-4", "post.reward=python_lines"))  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("wanka rl: ")]
    assert lines == ["wanka rl: post.reward changed from python_parses to python_lines since the "
                     "run started: use a new run.dir, or set it back"], r.stderr[-3000:]  # fmt: skip
    assert {f: (out / f).read_text() for f in before} == before
