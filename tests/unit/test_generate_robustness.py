"""`wanka generate` / `wanka bench decode` on awkward input and exits: prompt files taken as
written (escapes, line ends, BOM), Ctrl-C while loading, a model with NaN weights, a reader
that closes the pipe early, bench flags checked before the run, and a mean acceptance length
that counts only the tokens kept.

The run directory is a tiny MLA model imported from a Hugging Face export (as in
test_decode_badinput.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wanka.cli import main
from wanka.infer.cli import read_prompts
from wanka.infer.generate import Generator

from .test_decode import constant_model
from .tiny_hf import imported_run, one_line_error

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return imported_run(tmp_path_factory.mktemp("gen"))


def _prompts_of(tmp_path: Path, data: bytes) -> list[str]:
    f = tmp_path / "p.txt"
    f.write_bytes(data)
    return read_prompts(str(f))


# -- 1. prompt files -------------------------------------------------------------------------


def test_backslash_escapes_are_newline_and_backslash_only(tmp_path):
    lines = [
        r"first\nsecond",  # the documented escape: a newline
        r'x = "a\\nb"',  # an escaped backslash: code keeps its literal \n
        r"C:\\new\\table",
        r"C:\temp\x",  # a backslash before anything else is kept as it is
        "ends with \\",
    ]
    got = _prompts_of(tmp_path, "\n".join(lines).encode())
    assert got == ["first\nsecond", 'x = "a\\nb"', "C:\\new\\table", "C:\\temp\\x", "ends with \\"]
    # JSONL lines are JSON: no second unescaping on top of it.
    got = _prompts_of(tmp_path, json.dumps({"prompt": 'x = "a\\nb"'}).encode())
    assert got == ['x = "a\\nb"']


def test_lines_end_at_newline_only(tmp_path):
    data = "a\x0cb\nc\u2028d\ne\x1cf\r\n" + json.dumps({"prompt": "g\u2028h"}, ensure_ascii=False)
    assert len(data.splitlines()) == 8  # where str.splitlines cuts
    got = _prompts_of(tmp_path, data.encode())
    assert got == ["a\x0cb", "c\u2028d", "e\x1cf", "g\u2028h"]
    assert _prompts_of(tmp_path, b"one\r\ntwo\r\n\r\n") == ["one", "two"]


def test_a_utf8_bom_is_not_part_of_the_first_prompt(tmp_path):
    bom = b"\xef\xbb\xbf"
    assert _prompts_of(tmp_path, bom + b"hello\nworld\n") == ["hello", "world"]
    assert _prompts_of(tmp_path, bom + b'{"prompt": "def f("}\n') == ["def f("]
    with pytest.raises(ValueError, match=r"p\.txt:2: not UTF-8"):
        _prompts_of(tmp_path, bom + b"fine\nab\xffcd\n")


def test_prompts_reach_the_model_as_written(run_dir, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbf" + rb'x = "a\\nb"' + b"\n" + "c\u2028d".encode() + b"\n")
    capsys.readouterr()
    argv = ["generate", str(run_dir), "--prompts", str(f), "--json", "--max-new-tokens", "2"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ['x = "a\\nb"', "c\u2028d"]


# -- 2. Ctrl-C while the checkpoint loads ----------------------------------------------------


def test_ctrl_c_while_loading_is_not_a_bad_checkpoint(run_dir, monkeypatch, capsys):
    from torch.distributed.checkpoint import FileSystemReader

    from wanka.infer import load

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # raised by dcp.load itself
        m.setattr(load.dcp, "load", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load.load_trained(run_dir)
    # Raised while DCP reads the data: DCP wraps it in a CheckpointException, unwrapped here.
    with monkeypatch.context() as m:
        m.setattr(FileSystemReader, "read_data", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load.load_trained(run_dir)
        capsys.readouterr()
        assert main(["generate", str(run_dir), "--prompt", "a"]) == 130
        assert "does not fit" not in capsys.readouterr().err


# -- 3. a model with NaN weights -------------------------------------------------------------


def _nan_loader(monkeypatch, where: str) -> None:
    """load_trained, then one weight set to NaN: `norm` (the main model's last norm) or
    `mtp` (the MTP module's)."""
    from wanka.infer import load

    real = load.load_trained

    def damaged(*args, **kwargs):
        model, cfg, ckpt = real(*args, **kwargs)
        module = model.norm if where == "norm" else model.mtp[0].norm
        with torch.no_grad():
            module.weight[0] = float("nan")
        return model, cfg, ckpt

    monkeypatch.setattr(load, "load_trained", damaged)


@pytest.mark.parametrize("flags", [["--temperature", "1"], [], ["--speculate", "2"]])
def test_nan_weights_are_one_line(run_dir, monkeypatch, capsys, flags):
    _nan_loader(monkeypatch, "norm")
    argv = ["generate", str(run_dir), "--prompt", "def f(", "--max-new-tokens", "4", *flags]
    one_line_error(capsys, argv, "the model's logits are not finite at the prompt")


def test_nan_in_the_mtp_module_is_named(run_dir, monkeypatch, capsys):
    _nan_loader(monkeypatch, "mtp")
    # --json: the first token (from the main model) would stream before the drafts fail.
    argv = ["generate", str(run_dir), "--prompt", "def f(", "--speculate", "2", "--json",
            "--max-new-tokens", "8"]  # fmt: skip
    last = one_line_error(capsys, argv, "the MTP module's logits are not finite at draft 1")
    assert "check the checkpoint" in last


# -- 4. a reader that closes the pipe early --------------------------------------------------


def test_a_closed_pipe_ends_quietly(run_dir, tmp_path):
    """More output than the pipe holds, so generate is still writing when the reader leaves."""
    f = tmp_path / "p.txt"
    f.write_text("".join(f"prompt number {n}: hello\n" for n in range(1500)))
    cmd = [sys.executable, "-m", "wanka.cli", "generate", str(run_dir), "--prompts", str(f),
           "--json", "--batch-size", "1500", "--max-new-tokens", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=600)
    assert json.loads(first)["prompt"] == "prompt number 0: hello"
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 141, err  # 128 + SIGPIPE, as a Unix tool the reader left


# -- 5. wanka bench decode's flags -----------------------------------------------------------


def test_bench_decode_flags_are_checked_first(run_dir, tmp_path, capsys):
    run = str(run_dir)
    one_line_error(capsys, ["bench", "decode", run, "--out", str(tmp_path)],
                   f"--out {tmp_path} is a directory")  # fmt: skip
    (tmp_path / "file").write_text("")
    one_line_error(capsys, ["bench", "decode", run, "--out", str(tmp_path / "file" / "x.json")],
                   "cannot create its directory")  # fmt: skip
    for flag, bad in (("--batches", "a"), ("--batches", "1,0"), ("--contexts", "4k")):
        one_line_error(capsys, ["bench", "decode", run, flag, bad], f"{flag} '{bad}'")
    one_line_error(capsys, ["bench", "decode", run, "--prompt-tokens", "5000", "--contexts", "",
                            "--out", str(tmp_path / "r.json")],
                   "--prompt-tokens (5000) + --new-tokens (64) + --speculate (2)")  # fmt: skip
    assert not (tmp_path / "r.json").exists()


# -- 6. mean acceptance length ---------------------------------------------------------------


@pytest.mark.parametrize("speculate,max_new", [(5, 5), (3, 2), (2, 9), (5, 1)])
def test_mean_acceptance_length_counts_only_kept_tokens(speculate, max_new):
    gen = Generator(constant_model(), speculate=speculate)
    out = gen.generate([[1, 2, 3]], max_new)[0]
    assert out == [7] * max_new
    s = gen.stats
    assert s.mean_acceptance_length <= min(1 + speculate, max_new)
    # Every token after the prompt's comes from a round: the rounds' tokens are all but one.
    assert s.kept == max_new - 1 and s.tokens == max_new
    if s.rounds:
        assert s.mean_acceptance_length == (max_new - 1) / s.rounds


def test_bench_decode_mean_length_within_bounds(run_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "decode", str(run_dir), "--speculate", "5", "--new-tokens", "5",
            "--prompts", "1", "--prompt-tokens", "8", "--batches", "1", "--contexts", "",
            "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    sped = json.loads(out.read_text())["cases"][1]
    assert sped["speculate"] == 5 and sped["tokens"] == 5
    assert 1.0 <= sped["mean_acceptance_length"] <= 4.0  # 4 tokens after the prompt's
