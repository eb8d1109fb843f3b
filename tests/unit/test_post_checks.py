"""Post-training input checks that run before any rank starts (wanka/post/checks.py): the run
directory a job writes, its teachers and its prompts file, each refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from wanka.config.loader import dump_toml, load_config
from wanka.post.checks import (
    COMMAND_FILE,
    check_common,
    check_run_dir,
    check_teachers,
    tokenizer_identity,
)
from wanka.train.checkpoint import MARKER


def run_dir(path: Path, checkpoint: bool = True, **post) -> Path:
    """A directory that looks like a finished run: config.toml, one complete checkpoint."""
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, post=dataclasses.replace(cfg.post, **post))
    path.mkdir(parents=True)
    (path / "config.toml").write_text(dump_toml(cfg))
    if checkpoint:
        (path / "checkpoints" / "step-00000002").mkdir(parents=True)
        (path / "checkpoints" / "step-00000002" / MARKER).write_text("{}")
    return path


def job(tmp_path: Path, out: Path, init: Path, *sets: str):
    return load_config(None, [f"run.dir={out}", f"post.init={init}", *sets], check=False)


def one_line(info) -> str:
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("spelling", ["{init}", "{init}/", "{init}/../base"])
def test_run_dir_that_is_post_init_is_refused(tmp_path, spelling) -> None:
    """It used to overwrite post.init's config.toml with the job's, then resume from post.init's
    own checkpoints as if they were the job's."""
    init = run_dir(tmp_path / "base")
    before = (init / "config.toml").read_text()
    cfg = job(tmp_path, Path(spelling.format(init=init)), init)
    with pytest.raises(
        ValueError, match="is also post.init: the job would write.*new directory"
    ) as info:
        check_run_dir(cfg, "sft", {"post.init": str(init)})
    one_line(info)
    assert (init / "config.toml").read_text() == before


def test_run_dir_that_is_a_teacher_is_refused(tmp_path) -> None:
    init, teacher = run_dir(tmp_path / "base"), run_dir(tmp_path / "teacher")
    cfg = job(tmp_path, teacher, init)
    with pytest.raises(ValueError, match="is also the teacher for 'code': the job would"):
        check_run_dir(cfg, "distill", {"post.init": str(init), "the teacher for 'code'":
                                       str(teacher)})  # fmt: skip


def test_run_dir_of_pre_training_is_refused(tmp_path) -> None:
    """A `wanka train` run dir as run.dir: the job would resume from its checkpoints and
    truncate its metrics.jsonl."""
    init, other = run_dir(tmp_path / "base"), run_dir(tmp_path / "pretrained")
    with pytest.raises(ValueError, match="holds a run that is not post-training") as info:
        check_run_dir(job(tmp_path, other, init), "rl", {"post.init": str(init)})
    one_line(info)


def test_run_dir_of_another_post_command_is_refused(tmp_path) -> None:
    init = run_dir(tmp_path / "base")
    out = tmp_path / "distilled"
    out.mkdir()
    (out / "config.toml").write_text(dump_toml(job(tmp_path, out, init)))
    (out / COMMAND_FILE).write_text("distill\n")
    cfg = job(tmp_path, out, init)
    with pytest.raises(ValueError, match=r"holds a `wanka distill` run: `wanka rl` would resume"):
        check_run_dir(cfg, "rl", {"post.init": str(init)})
    check_run_dir(cfg, "distill", {"post.init": str(init)})  # its own command resumes
    (out / COMMAND_FILE).unlink()  # made before the file existed: post.init set, allowed
    check_run_dir(cfg, "rl", {"post.init": str(init)})


def test_post_init_needs_a_checkpoint_unless_the_job_resumes(tmp_path) -> None:
    init = run_dir(tmp_path / "base", checkpoint=False)
    out = tmp_path / "out"
    cfg = job(tmp_path, out, init)
    with pytest.raises(ValueError, match="post.init: .* has no complete checkpoint"):
        check_run_dir(cfg, "sft", {"post.init": str(init)})
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    (out / "checkpoints" / "step-00000001" / MARKER).write_text("{}")
    check_run_dir(cfg, "sft", {"post.init": str(init)})  # resumes from its own checkpoint
    with pytest.raises(ValueError, match="has no complete checkpoint"):  # rl: the KL reference
        check_run_dir(cfg, "rl", {"post.init": str(init)}, needs_init=True)


def test_teachers_cover_the_prompt_domains_and_share_the_vocabulary(tmp_path) -> None:
    init, t = run_dir(tmp_path / "base"), str(run_dir(tmp_path / "t"))
    cfg = job(tmp_path, tmp_path / "out", init)
    check_teachers(cfg, {"code": t, "prose": t}, ["code", "prose"])
    with pytest.raises(ValueError, match=r"no teacher for prompt domain\(s\) \['prose'\]"):
        check_teachers(cfg, {"code": t}, ["code", "prose"])
    with pytest.raises(ValueError, match=r"names domain 'Code', which no prompt has: did you "
                       r"mean 'code'\?"):  # fmt: skip
        check_teachers(cfg, {"code": t, "prose": t, "Code": t}, ["code", "prose"])
    # A spare teacher for a domain these prompts lack (not a near miss) is skipped.
    check_teachers(
        cfg, {"code": t, "prose": t, "math": str(tmp_path / "absent")}, ["code", "prose"]
    )
    # The same tokenizer file named two ways is one vocabulary; another file's content is not.
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "a"}')
    (tmp_path / "copy.json").write_text('{"model": "a"}')
    (tmp_path / "other.json").write_text('{"model": "b"}')
    assert tokenizer_identity(str(tok)) == tokenizer_identity(str(tmp_path / "copy.json"))
    assert tokenizer_identity(str(tok)) != tokenizer_identity(str(tmp_path / "other.json"))
    assert tokenizer_identity("byte") == tokenizer_identity("") == "byte"
    narrowed = job(tmp_path, tmp_path / "out", init, "post.domains=code")
    check_teachers(narrowed, {"code": t, "prose": t}, ["code"])  # post.domains drops prose
    text = (Path(t) / "config.toml").read_text().replace("vocab_size = 256", "vocab_size = 300")
    (Path(t) / "config.toml").write_text(text)
    with pytest.raises(ValueError, match=r"teacher for 'code': .* uses another vocabulary"):
        check_teachers(cfg, {"code": t, "prose": str(init)}, ["code", "prose"])
    nock = str(run_dir(tmp_path / "nock", checkpoint=False))
    with pytest.raises(ValueError, match="teacher for 'prose': .* has no complete checkpoint"):
        check_teachers(cfg, {"code": str(init), "prose": nock}, ["code", "prose"])


def test_check_common_reads_a_prompts_file_before_any_rank(tmp_path) -> None:
    init = run_dir(tmp_path / "base")
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"p{i}", "domain": d} for i, d in enumerate(["code", "math"] * 3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n{oops\n")
    cfg = job(tmp_path, tmp_path / "out", init, f"post.prompts={prompts}", "post.eval_prompts=1")
    with pytest.raises(ValueError, match=r"p.jsonl:7: not valid JSON"):
        check_common(cfg, samples_from_policy=True)
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    assert check_common(cfg, samples_from_policy=True) == ["code", "math"]
    few = job(tmp_path, tmp_path / "out", init, f"post.prompts={prompts}", "post.eval_prompts=3")
    with pytest.raises(ValueError, match="domain 'code' has 3 prompts, post.eval_prompts=3"):
        check_common(few, samples_from_policy=True)


def test_references_are_required_where_the_job_trains_on_them(tmp_path) -> None:
    init = run_dir(tmp_path / "base")
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "domain": "code", "reference": "b"}, {"prompt": "c", "domain": "code"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = job(tmp_path, tmp_path / "out", init, f"post.prompts={prompts}", "post.eval_prompts=0")
    assert check_common(cfg, True) == ["code"]  # on-policy: references are optional
    with pytest.raises(ValueError, match=r"post.sft_source='reference' trains on .* but 1 of "
                       r"the 2 training prompts .* have no \"reference\""):  # fmt: skip
        check_common(cfg, False, references_for="post.sft_source='reference'")


def test_far_too_many_builtin_held_out_prompts_are_refused_at_once(tmp_path) -> None:
    """Asking for 100000 used to spend about five minutes drawing before failing."""
    cfg = job(tmp_path, tmp_path / "out", run_dir(tmp_path / "base"), "post.eval_prompts=100000")
    with pytest.raises(ValueError, match="post.eval_prompts=100000: .* ask for at most 2000"):
        check_common(cfg, True)


def test_a_teacher_shorter_than_the_job_names_the_job_setting() -> None:
    from wanka.config import load_config
    from wanka.post.checks import check_frozen_model

    cfg = load_config(None, ["data.seq_len=128", "parallel.ep=1"])
    teacher = load_config(None, ["model.max_seq_len=64", "data.seq_len=64"]).model
    with pytest.raises(ValueError, match=r"teacher for 'code': its model.max_seq_len=64 is below "
                                         r"this job's data.seq_len=128 \(post.init's\): use a model"):  # fmt: skip
        check_frozen_model(cfg, teacher, "teacher for 'code'")


def test_post_init_finds_a_moved_runs_own_tokenizer(tmp_path) -> None:
    from wanka.post.engine import run_config

    run = tmp_path / "moved"
    run.mkdir()
    cfg = load_config(None, ['data.tokenizer="/gone/imported/tokenizer.json"'], check=False)
    (run / "config.toml").write_text(dump_toml(cfg))
    (run / "tokenizer.json").write_text("{}")  # the copy `wanka import` keeps in the run
    assert run_config(run, "post.init").data.tokenizer == str(run / "tokenizer.json")
    (run / "tokenizer.json").unlink()  # none to find: as written, for the loader's own error
    assert run_config(run, "post.init").data.tokenizer == "/gone/imported/tokenizer.json"


def test_a_teachers_own_config_errors_name_the_teacher_and_its_run(tmp_path) -> None:
    """A teacher's config.toml that fails validation read as the job's own config error
    ("config error at data.seq_len: 128 > model.max_seq_len=64")."""
    init, t = run_dir(tmp_path / "base"), run_dir(tmp_path / "t")
    text = (t / "config.toml").read_text()
    (t / "config.toml").write_text(text.replace("max_seq_len = 4096", "max_seq_len = 64"))
    cfg = job(tmp_path, tmp_path / "out", init, "parallel.ep=1")
    with pytest.raises(ValueError, match=rf"^teacher for 'code': {t}/config.toml: config error "
                       r"at data.seq_len: .* > model.max_seq_len=64: fix that run's config") as info:  # fmt: skip
        check_teachers(cfg, {"code": str(t), "prose": str(init)}, ["code", "prose"])
    one_line(info)
    # Valid on its own but not in this job (its experts do not split over parallel.ep).
    (t / "config.toml").write_text(text.replace("n_experts = 8", "n_experts = 6"))
    odd = job(tmp_path, tmp_path / "out", init, "parallel.ep=4", "parallel.dp_shard=4")
    with pytest.raises(ValueError, match=rf"^teacher for 'code' \({t}\): config error at "):
        check_teachers(odd, {"code": str(t), "prose": str(init)}, ["code", "prose"])


def test_overrides_the_command_drops_or_never_reads_are_said(capsys) -> None:
    """`wanka sft --set model.dim=64` trained post.init's model (128) and wrote no word;
    `wanka distill --set post.samples_per_prompt=3` changed nothing, silently."""
    from wanka.cli import main
    from wanka.post.cli import _say_unused

    assert main(["sft", "configs/sft.toml", "--set", "model.dim=64"]) == 2
    err = capsys.readouterr().err
    assert "--set model.dim: post-training takes [model] and [data] from post.init's run" in err
    _say_unused("distill", ["post.samples_per_prompt=3", "post.beta=0.3", "train.lr=1e-4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["wanka distill: --set post.samples_per_prompt changes nothing here (it is for "
                   "`wanka rl`)"], err  # fmt: skip
    _say_unused("sft", ["post.teachers=code=x"])  # sft reads teachers too
    assert capsys.readouterr().err == ""
