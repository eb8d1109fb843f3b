"""The `wanka` command end to end, as a user runs it."""

import json

import pytest

from .helpers import wanka


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`wanka train` on 2 ranks (dp 2 x ep 2) with the demo config, shortened to 4 steps (~1.5 s
    each here): an eval and a checkpoint mid-run (step 2) and at the end (step 4)."""
    run_dir = tmp_path_factory.mktemp("run") / "demo"
    r = wanka("train", "configs/demo.toml", "--nproc", "2", "--set", "train.steps=4",
              "--set", "train.eval_every=2", "--set", "checkpoint.every=2", "--set", "data.val_batches=2",
              "--set", "run.tensorboard=false", "--set", f'run.dir="{run_dir}"')  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return run_dir, r


def test_train_end_to_end(trained):
    run_dir, r = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert 0 < summary["val_loss"] < 6 and summary["tokens_per_s"] > 0
    assert (run_dir / "checkpoints" / "step-00000002" / "COMPLETE").is_file()  # mid-run
    assert (run_dir / "checkpoints" / "step-00000004" / "COMPLETE").is_file()
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "logs" / "rank0.log").is_file() and (run_dir / "logs" / "rank1.log").is_file()
    assert "validation loss" in r.stdout and "step 4/4" in r.stdout + r.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    assert [x["step"] for x in rows if x["kind"] == "eval"] == [2, 4]  # mid-run and final
    for key in (
        "lm_loss",
        "mtp_loss",
        "indexer_kl",
        "moe_balance",
        "grad_norm",
        "lr",
        "tokens_per_s",
    ):
        assert key in train[-1], key


def test_report_draws_png(trained):
    run_dir, _ = trained
    (run_dir / "loss_curve.png").unlink()
    r = wanka("report", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert (run_dir / "loss_curve.png").is_file()


def test_error_inside_ranks_is_one_line(trained):
    """An error that only the ranks can see (here: resuming a different model) ends as one line
    from rank 0 and exit code 2, not torchrun's failure report."""
    run_dir, _ = trained
    r = wanka("train", "configs/demo.toml", "--nproc", "2", "--set", "train.steps=4",
              "--set", "model.index_topk=32", "--set", f'run.dir="{run_dir}"')  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "model.index_topk: saved 64, now 32" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_rerun_resumes_and_finishes(trained):
    """Running the same job again finds the final checkpoint, does no extra steps and says so;
    the finished run's summary and metrics stay as they were (a rerun overwrote the summary
    with nulls and logged a second final eval)."""
    run_dir, _ = trained
    before = {f: (run_dir / f).read_bytes() for f in ("summary.json", "metrics.jsonl")}
    assert json.loads(before["summary.json"])["train_loss"] is not None
    r = wanka("train", "configs/demo.toml", "--set", "train.steps=4", "--set", "parallel.ep=1",
              "--set", "data.val_batches=2", "--set", "run.tensorboard=false", "--set", f'run.dir="{run_dir}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already finished its 4 steps: nothing to train" in r.stdout + r.stderr
    assert {f: (run_dir / f).read_bytes() for f in before} == before


def test_a_run_killed_after_its_last_checkpoint_finishes_its_end_on_rerun(trained):
    """Killed after the final checkpoint but before its summary (in the final eval, say): the
    rerun does the end again instead of calling the run finished without a summary."""
    run_dir, _ = trained
    summary = run_dir / "summary.json"
    kept = summary.read_bytes()
    summary.unlink()
    try:
        r = wanka("train", "configs/demo.toml", "--set", "train.steps=4", "--set", "parallel.ep=1",
                  "--set", "data.val_batches=2", "--set", "run.tensorboard=false", "--set", f'run.dir="{run_dir}"')  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert "already finished" not in r.stdout + r.stderr
        assert json.loads(summary.read_text())["resumed_from_step"] == 4
    finally:
        summary.write_bytes(kept)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "model.n_heads=3"], "model.n_heads"),
        (["--set", "train.stepz=3"], "did you mean 'steps'"),
        (["--set", "parallel.ep=2", "--nproc", "1"], "parallel.ep=2 must divide"),
        (["--set", "parallel.dp_shard=4", "--nproc", "2"], "does not match the world size"),
        (["--set", 'data.path="/nonexistent/ds"', "--nproc", "2"], "wanka data prepare"),
        (["--set", "train.log_every=0"], "train.log_every"),
        (
            ["--set", "checkpoint.load=/nonexistent/ck", "--set", "parallel.ep=1"],
            "checkpoint.load='/nonexistent/ck' is not a directory",
        ),
    ],
)
def test_bad_input_gives_one_line_error(args, fragment, tmp_path):
    r = wanka("train", "configs/demo.toml", "--set", f'run.dir="{tmp_path}"', *args)
    assert r.returncode == 2
    assert fragment in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_data_prepare_and_train_on_it(tmp_path):
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"hello wanka, document {i}. " * (50 + 40 * i))
    (tmp_path / "more.jsonl").write_text(
        "\n".join(json.dumps({"text": f"line {i} " * 30}) for i in range(20))
    )
    out = tmp_path / "ds"
    r = wanka("data", "prepare", *map(str, sorted(tmp_path.glob("doc*.txt"))), str(tmp_path / "more.jsonl"),
              "--out", str(out), "--val-fraction", "0.2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 256
    r = wanka("train", "--set", f'data.path="{out}"', "--set", "data.seq_len=64", "--set", "train.steps=2",
              "--set", "data.val_batches=1", "--set", "train.micro_batch_size=2",
              "--set", "run.tensorboard=false", "--set", f'run.dir="{tmp_path / "run"}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    # Longer than the whole val split: refused once, before any rank starts. (A split shorter
    # than a batch but longer than a window is read round-robin instead.) The window is longer
    # than the whole corpus (~27k tokens): which documents land in val depends on their paths.
    r = wanka("train", "--nproc", "2", "--set", f'data.path="{out}"', "--set", "data.seq_len=65536",
              "--set", "model.max_seq_len=65536", "--set", f'run.dir="{tmp_path / "run2"}"')  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "one window of seq_len" in r.stderr, r.stderr


def test_a_run_on_data_prepared_with_a_tokenizer_records_that_tokenizer(tmp_path):
    """The run's config is what generate / export / post-training decode with: it said
    data.tokenizer = "byte" for data prepared with a tokenizer.json. The run keeps its own
    copy: generate still works after the user moved the file (it said "tokenizer file not
    found" with no way to pass one)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from wanka.config import load_config

    words = [f"w{i}" for i in range(200)]
    hf = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    hf.save(str(tmp_path / "my_vocab.json"))
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(
            " ".join(words[(7 * i + j) % 200] for j in range(400))
        )
    out = tmp_path / "ds"
    r = wanka("data", "prepare", *map(str, sorted(tmp_path.glob("doc*.txt"))), "--out", str(out),
              "--tokenizer", str(tmp_path / "my_vocab.json"), "--val-fraction", "0.2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = wanka("train", "--set", f'data.path="{out}"', "--set", "data.seq_len=64", "--set", "train.steps=1",
              "--set", "data.val_batches=1", "--set", "train.micro_batch_size=2",
              "--set", "run.tensorboard=false", "--set", f'run.dir="{tmp_path / "run"}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    saved = load_config(str(tmp_path / "run" / "config.toml"), [])
    assert saved.data.tokenizer == str((tmp_path / "my_vocab.json").resolve())
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (
        tmp_path / "my_vocab.json"
    ).read_bytes()
    (tmp_path / "my_vocab.json").rename(tmp_path / "moved.json")
    r = wanka("generate", str(tmp_path / "run"), "--prompt", "w1 w2", "--max-new-tokens", "3")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.startswith("w1 w2"), r.stdout


def test_model_info_for_production_flavor():
    r = wanka("model", "x25-293b", "--dp", "1024", "--ep", "32", "--seq-len", "8192")
    assert r.returncode == 0, r.stderr
    assert "total 291." in r.stdout and "active" in r.stdout and "GiB" in r.stdout
    assert "mla" in r.stdout.lower()  # the production flavor runs DeepSeek-V3.2's MLA


def test_resume_guards(tmp_path):
    """A run dir's checkpoints are never silently mixed with another model or a fresh run."""
    base = ["train", "--set", "train.steps=2", "--set", "data.val_batches=1", "--set", "parallel.ep=1",
            "--set", "run.tensorboard=false", "--set", f'run.dir="{tmp_path}"']  # fmt: skip
    assert wanka(*base).returncode == 0
    saved = (tmp_path / "config.toml").read_text()
    for extra, fragment in [
        # (A smaller model, whose weights DCP would load as a subset, is caught by the same
        # config comparison as index_topk below.)
        (["--set", "model.n_layers=5"], "does not fit this model"),
        (["--set", "model.index_topk=32"], "model.index_topk: saved 64, now 32"),
        (["--set", "checkpoint.load=none"], "already holds checkpoints"),
    ]:
        r = wanka(*base, *extra)
        assert r.returncode == 2 and fragment in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        # A refused resume leaves the run's config as it was (generate/export read it).
        assert (tmp_path / "config.toml").read_text() == saved
    # A resumed run may change optimizer settings on purpose: the config wins over the checkpoint.
    r = wanka(*base[:2], "train.steps=3", *base[3:], "--set", "train.lr=1e-5", "--set", "train.warmup_steps=0",
              "--set", "train.min_lr_ratio=1.0")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in rows if x["kind"] == "train"][-1]
    assert last["step"] == 3 and last["lr"] == pytest.approx(1e-5)


def test_init_weights_starts_a_new_run_on_other_data(tmp_path):
    """checkpoint.init_weights: a new run (other data, so its loader could not resume) starts
    from a trained run's weights: model only, step 0. With an lr too small to move them, its
    final weights are the source's."""
    import torch

    from wanka.data.corpus import Document
    from wanka.data.prepare import prepare_documents
    from wanka.data.tokenizer import ByteTokenizer
    from wanka.infer.load import load_trained

    common = ["--set", "data.val_batches=1", "--set", "parallel.ep=1", "--set",
              "run.tensorboard=false", "--set", "resilience.supervise=false",
              "--set", "model.bias_update_rate=0"]  # fmt: skip
    src = tmp_path / "src"
    r = wanka("train", *common, "--set", "train.steps=2", "--set", "checkpoint.every=1",
              "--set", f'run.dir="{src}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    docs = [Document(f"d{i}", f"other text {i} " * 400) for i in range(40)]
    data = prepare_documents(docs, tmp_path / "mine", ByteTokenizer(), 0.1)
    new = [*common, "--set", f'data.path="{data}"', "--set", "train.steps=1",
           "--set", "train.warmup_steps=0", "--set", f'run.dir="{tmp_path / "new"}"']  # fmt: skip
    # Resuming the source run on other data is refused, naming the way out.
    r = wanka("train", *common, "--set", "train.steps=3", "--set", f'data.path="{data}"',
              "--set", f'run.dir="{src}"')  # fmt: skip
    assert r.returncode == 2 and "checkpoint.init_weights" in r.stderr, r.stderr[-2000:]
    r = wanka(
        "train",
        *new,
        "--set",
        "train.lr=1e-12",
        "--set",
        "train.indexer_lr=0",
        "--set",
        "model.bias_update_rate=0",
        "--set",
        f'checkpoint.init_weights="{src}"',
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "starting from the weights of" in (tmp_path / "new" / "logs" / "rank0.log").read_text()
    rows = [json.loads(x) for x in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["kind"] == "train"] == [1]
    a, b = (load_trained(d)[0].state_dict() for d in (src, tmp_path / "new"))
    moved = [k for k in a if not torch.allclose(a[k], b[k], atol=1e-6)]
    assert not moved, moved
    # A damaged newest checkpoint of the source run is passed over (and left unflagged there).
    blob = next(p for p in sorted((src / "checkpoints" / "step-00000002").iterdir())
                if p.suffix == ".distcp")  # fmt: skip
    blob.write_bytes(blob.read_bytes()[:-8] + b"damaged!")
    r = wanka("train", *new, "--set", f'checkpoint.init_weights="{src}"',
              "--set", f'run.dir="{tmp_path / "new2"}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "new2" / "logs" / "rank0.log").read_text()
    assert "starting from the weights of" in log and "step-00000001" in log
    assert not list((src / "checkpoints").glob("*/CORRUPT"))
    # Bad sources: one line each.
    for given, says in [(tmp_path / "mine", "holds no complete, undamaged checkpoint"),
                        (tmp_path / "absent", "no checkpoint directory")]:  # fmt: skip
        (tmp_path / "mine" / "checkpoints").mkdir(exist_ok=True)
        r = wanka("train", *new, "--set", f'checkpoint.init_weights="{given}"',
                  "--set", f'run.dir="{tmp_path / "bad"}"')  # fmt: skip
        assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = wanka("train", *new, "--set", "model.n_layers=3", "--set", f'checkpoint.init_weights="{src}"',
              "--set", f'run.dir="{tmp_path / "bad2"}"')  # fmt: skip
    assert r.returncode == 2 and "checkpoint.init_weights" in r.stderr, r.stderr[-2000:]
