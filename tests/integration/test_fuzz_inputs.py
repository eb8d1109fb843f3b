"""A fuzz suite of malformed inputs a newcomer (or a typo) produces: every one must be answered
with exactly one line on stderr, exit code 2 and no traceback. Configs, overrides and data
inputs go through the real `wanka` entry point (in-process: a traceback would raise here)."""

from __future__ import annotations

import json

import pytest

from wanka.cli import main

DEMO = "configs/demo.toml"

# (TOML text of a job file) -> must be refused. Each names a different way to get it wrong.
BAD_TOML = [
    "[model\nflavor = 'tiny'",  # unclosed table
    "[model]\nflavor = tiny",  # bare word
    "[model]\nflavor = 'huge'",
    "[model]\ndim = '128'",
    "[model]\ndim = 128.5",
    "[model]\ndim = true",
    "[model]\ndim = -1",
    "[model]\nn_heads = 3",
    "[model]\nhead_dim = 31",
    "[model]\nn_experts = 0",
    "[model]\nn_active_experts = 9",
    "[model]\nn_dense_layers = 9",
    "[model]\nvocab_size = 0",
    "[model]\nindex_head_dim = 7",
    "[model]\nmax_seq_len = 99999999",
    "[model]\nmtp_depth = -1",
    "[model]\nnorm_eps = 0.0",
    "[model]\nroute_scale = -2.0",
    "[model]\nn_expert_groups = 3",
    "[model]\nn_expert_groups = 2\nn_limited_groups = 3",
    "[model]\ndimm = 128",  # typo
    "[modle]\ndim = 128",  # typo in a table
    "model = 3",
    "[train]\nsteps = 0",
    "[train]\nsteps = 1e20",
    "[train]\nsteps = 100000000000000000000",
    "[train]\nlr = inf",
    "[train]\nlr = nan",
    "[train]\nlr = -1.0",
    "[train]\ngrad_clip = nan",
    "[train]\nbeta1 = 1.0",
    "[train]\nbeta2 = 2.0",
    "[train]\nweight_decay = 1e9",
    "[train]\nindexer_lr = -3e-3",
    "[train]\nmicro_batch_size = 0",
    "[train]\ngrad_accum = -2",
    "[train]\nphase = 'dense'",
    "[train]\nmixed_precision = 'fp16'",
    "[train]\nactivation_checkpointing = 'yes'",
    "[train]\nlr_schedule = 'linear'",
    "[train]\ndecay_fraction = 1.5",
    "[train]\nlr_horizon = 5\nwarmup_steps = 20",
    "[train]\nmin_lr_ratio = 2.0",
    "[train]\ndense_warmup_steps = 500\nsteps = 100",
    "[train]\nwarmup_steps = -1",
    "[train]\neval_every = 0",
    "[data]\nseq_len = 0",
    "[data]\nseq_len = 99999",
    "[data]\npath = '/nonexistent/dataset'",
    "[data]\nval_batches = 0",
    "[parallel]\nep = 3",
    "[parallel]\nep = 0",
    "[parallel]\ndp_shard = 0",
    "[checkpoint]\nevery = -5",
    "[checkpoint]\nmtbf_s = 0.0",
    "[checkpoint]\nkeep = 0",
    "[resilience]\nhang_factor = 0.0",
    "[resilience]\nbackoff_s = -1.0",
    "[resilience]\npreflight = 'maybe'",
    "[resilience]\nsnapshot_every = -1",
    "[resilience]\nsnapshot_max_age_h = 0.0",
]

BAD_SETS = [
    "train.steps",  # no '='
    "train.steps=abc",
    "train.lr=1e400",
    "nosuch.key=1",
    "train.nosuch=1",
    "model.dim.x=1",
    "train.steps=[1, 2]",
    "model.flavor=3",
]


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    """stderr's one line; `wanka check` also prints its report (FAIL lines) on stdout."""
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert len(err.splitlines()) == 1 and "Traceback" not in err + captured.out, err
    return err + "\n" + captured.out


@pytest.mark.parametrize("text", BAD_TOML)
def test_malformed_job_file(text, tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text(text + "\n")
    _one_line_exit_2(capsys, ["check", str(cfg)])


@pytest.mark.parametrize("override", BAD_SETS)
def test_malformed_override(override, capsys):
    _one_line_exit_2(capsys, ["check", DEMO, "--set", override])


def test_missing_job_file(capsys):
    err = _one_line_exit_2(capsys, ["check", "configs/nosuch.toml"])
    assert "no such config file" in err


def _bad_data_inputs(tmp_path):
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text key"}\n')
    (tmp_path / "notobj.jsonl").write_text("[1, 2]\n")
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    (tmp_path / "doc.pdf").write_text("%PDF")
    (tmp_path / "tok.json").write_text("{]")
    (tmp_path / "ok.txt").write_text("hello world " * 20)
    (tmp_path / "empty.txt").write_text("")
    return [
        [str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")],
        [str(tmp_path / "latin.txt"), "--out", str(tmp_path / "o")],
        [str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")],
        [str(tmp_path / "notobj.jsonl"), "--out", str(tmp_path / "o")],
        [str(tmp_path / "num.jsonl"), "--out", str(tmp_path / "o")],
        [str(tmp_path / "doc.pdf"), "--out", str(tmp_path / "o")],
        [
            str(tmp_path / "ok.txt"),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "tok.json"),
        ],  # fmt: skip
        [
            str(tmp_path / "ok.txt"),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "nope.json"),
        ],  # fmt: skip
        [str(tmp_path / "ok.txt"), "--out", str(tmp_path / "ok.txt")],
        [str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")],
        [str(tmp_path), "--out", str(tmp_path / "inside")],
    ]


def test_malformed_data_inputs(tmp_path, capsys):
    for args in _bad_data_inputs(tmp_path):
        _one_line_exit_2(capsys, ["data", "prepare", *args])
        assert not (tmp_path / "o").exists()
    assert (tmp_path / "ok.txt").read_text().startswith("hello")  # inputs never written over


def test_train_on_raw_documents_points_at_prepare(tmp_path, capsys):
    raw = tmp_path / "mine.jsonl"
    raw.write_text(json.dumps({"text": "a document"}) + "\n")
    out = _one_line_exit_2(capsys, ["check", DEMO, "--set", f'data.path="{raw}"'])
    assert "wanka data prepare" in out and f"--out {raw} " not in out
