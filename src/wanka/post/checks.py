"""Post-training input checks, run before any rank starts: each refusal is one line naming
the key to change."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import tomllib
from pathlib import Path

from wanka.config.loader import validate
from wanka.config.schema import JobConfig, ModelConfig
from wanka.post.engine import check_has_checkpoint, run_config
from wanka.post.prompts import DOMAINS, domains, split_jsonl_prompts
from wanka.train.checkpoint import complete_checkpoints

# In a post-training run directory: the command that made it (one line), so that another
# command, which would resume from its checkpoints and append to its metrics, is refused.
COMMAND_FILE = "post_command"
# Held-out built-in prompts per domain: the val documents give a few hundred (890 code, 327
# prose at the default 96 chars), and a request beyond that fails only after 10 draws per
# prompt asked (minutes): far more is refused at once.
MAX_BUILTIN_EVAL_PROMPTS = 2000


def with_policy_model(cfg: JobConfig) -> JobConfig:
    """The job config with post.init's [model] and [data] in place, validated as a whole (so
    that e.g. parallel.ep is judged against the policy's experts, not the defaults)."""
    if not cfg.post.init:
        raise ValueError("post.init is empty: name the run directory (a finished `wanka train` "
                         "or `wanka import`) the policy starts from")  # fmt: skip
    init = run_config(cfg.post.init, "post.init")
    merged = dataclasses.replace(cfg, model=init.model, data=init.data)
    validate(merged)
    return merged


def check_frozen_model(cfg: JobConfig, model: ModelConfig, role: str) -> None:
    """A teacher or reference is sharded like the policy: its experts must split over ep."""
    if model.max_seq_len < cfg.data.seq_len:  # else validate names the job's own seq_len
        raise ValueError(f"{role}: its model.max_seq_len={model.max_seq_len} is below this "
                         f"job's data.seq_len={cfg.data.seq_len} (post.init's): use a model "
                         f"trained for sequences of {cfg.data.seq_len} tokens or more")  # fmt: skip
    try:
        validate(dataclasses.replace(cfg, model=model))
    except ValueError as e:
        raise ValueError(f"{role}: {e}") from None


def check_common(cfg: JobConfig, samples_from_policy: bool, references_for: str = "") -> list[str]:
    """Ranges and the prompts (a JSONL file is read here, so its problems are one line before
    any rank starts). `references_for`: the setting that trains on the prompts' "reference"
    continuations, when it does: every training prompt must then have one. Returns the
    domains the job trains on."""
    p = cfg.post
    if cfg.checkpoint.init_weights:
        raise ValueError("checkpoint.init_weights is `wanka train`'s: post-training starts from "
                         "post.init's weights; set post.init instead")  # fmt: skip
    if cfg.checkpoint.load not in ("latest", "none"):
        raise ValueError(f"checkpoint.load={cfg.checkpoint.load!r}: post-training resumes from "
                         "its own newest checkpoint ('latest') or starts over ('none'); to "
                         "start from another run's weights, set post.init")  # fmt: skip
    positive = {"post.prompts_per_step": p.prompts_per_step,
                "post.completion_tokens": p.completion_tokens, "post.prompt_chars": p.prompt_chars,
                "post.samples_per_prompt": p.samples_per_prompt, "train.eval_every": cfg.train.eval_every}  # fmt: skip
    if cfg.checkpoint.enable:
        positive["checkpoint.every"] = cfg.checkpoint.every
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key}={value}: must be 1 or more")
    if p.prompts == "builtin" and p.eval_prompts > MAX_BUILTIN_EVAL_PROMPTS:
        raise ValueError(f"post.eval_prompts={p.eval_prompts}: the built-in held-out documents "
                         f"give a few hundred prompts per domain at most: ask for at most "
                         f"{MAX_BUILTIN_EVAL_PROMPTS} (drawing more only fails, minutes later)")  # fmt: skip
    if p.eval_prompts < (1 if p.prompts == "builtin" else 0):
        raise ValueError(f"post.eval_prompts={p.eval_prompts}: held-out prompts per domain, "
                         "1 or more with the built-in prompts")  # fmt: skip
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"post.top_p={p.top_p}: the nucleus mass is in (0, 1]")
    if samples_from_policy and not p.temperature > 0.0:
        raise ValueError(f"post.temperature={p.temperature}: on-policy training samples, so "
                         "it must be > 0 (1.0 samples the policy's own distribution)")  # fmt: skip
    if p.prompts == "builtin" and p.domains.strip():
        unknown = sorted({x.strip() for x in p.domains.split(",") if x.strip()} - set(DOMAINS))
        if unknown:
            raise ValueError(f"post.domains names {unknown}, but the built-in prompts have the "
                             f"domains {list(DOMAINS)}")  # fmt: skip
    if cfg.parallel.cp != 1:
        raise ValueError("post-training runs without context parallelism (completions are "
                         "short): set parallel.cp=1")  # fmt: skip
    wanted = {x.strip() for x in p.domains.split(",") if x.strip()} or None
    if p.prompts == "builtin":
        return [d for d in DOMAINS if wanted is None or d in wanted]
    train = split_jsonl_prompts(p.prompts, wanted, p.eval_prompts)[0]
    bare = sum(not x.reference for x in train)
    if references_for and bare:
        raise ValueError(f"{references_for} trains on the prompts' reference continuations, but "
                         f"{bare} of the {len(train)} training prompts in {p.prompts} have no "
                         '"reference": add them, or change ' + references_for.split("=")[0])  # fmt: skip
    return domains(train)


def tokenizer_identity(spec: str) -> str:
    """What a tokenizer spec means, for comparing two runs: "byte", or the sha256 of the
    tokenizer.json it names (a folder or a path, relative or absolute: the same file's content
    is the same tokenizer; `wanka import` records absolute paths of its own copy)."""
    if spec in ("", "byte"):
        return "byte"
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    try:
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return spec  # unreadable here: the spec itself (loading it will say what is wrong)


def check_vocabulary(cfg: JobConfig, tcfg: JobConfig, run_dir: str, role: str) -> None:
    """Distillation compares distributions token by token: one vocabulary and tokenizer."""
    if tcfg.model.vocab_size != cfg.model.vocab_size or tokenizer_identity(
        tcfg.data.tokenizer
    ) != tokenizer_identity(cfg.data.tokenizer):
        raise ValueError(f"{role}: {run_dir} uses another vocabulary "
                         f"({tcfg.data.tokenizer}, {tcfg.model.vocab_size}) than the student "
                         f"({cfg.data.tokenizer}, {cfg.model.vocab_size}): distillation compares "
                         "distributions token by token: pick a teacher trained with the "
                         "student's tokenizer")  # fmt: skip


def parse_teachers(spec: str) -> dict[str, str]:
    """ "code=runs/t-code,prose=runs/t-prose" -> {domain: run directory}."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        domain, sep, run_dir = item.partition("=")
        if not sep or not domain.strip() or not run_dir.strip():
            raise ValueError(f"post.teachers: {item!r} is not DOMAIN=RUN_DIR: write e.g. "
                             "post.teachers=\"code=runs/t-code,prose=runs/t-prose\"")  # fmt: skip
        if domain.strip() in out:
            raise ValueError(f"post.teachers names domain {domain.strip()!r} twice: one teacher "
                             "per domain")  # fmt: skip
        out[domain.strip()] = run_dir.strip()
    if not out:
        raise ValueError("post.teachers is empty: give one teacher per prompt domain, e.g. "
                         "post.teachers=\"code=runs/t-code,prose=runs/t-prose\"")  # fmt: skip
    return out


def check_teachers(cfg: JobConfig, teachers: dict[str, str], used: list[str]) -> None:
    """Each teacher: a run directory with a checkpoint, sharded like the policy, with the
    policy's vocabulary; one for every prompt domain `used`. A teacher for a domain the prompts
    lack is skipped, unless its name is a near miss of a prompt domain (a typo)."""
    missing = sorted(set(used) - set(teachers))
    if missing:
        raise ValueError(f"post.teachers has no teacher for prompt domain(s) {missing}: add "
                         f"DOMAIN=RUN_DIR for each (the prompts' domains: {used})")  # fmt: skip
    for name in sorted(set(teachers) - set(used)):
        near = difflib.get_close_matches(name.strip().lower(), [d.lower() for d in used], n=1)
        if near:
            raise ValueError(f"post.teachers names domain {name!r}, which no prompt has: did you "
                             f"mean {near[0]!r}? (the prompts' domains: {used})")  # fmt: skip
    for domain, run_dir in sorted(teachers.items()):
        if domain not in used:
            continue
        role = f"teacher for {domain!r}"
        tcfg = run_config(run_dir, role)
        # Its own model judged in this job's config: name whose model it is, and where.
        check_frozen_model(cfg, tcfg.model, f"{role} ({run_dir})")
        check_vocabulary(cfg, tcfg, run_dir, role)
        check_has_checkpoint(run_dir, role)


def check_run_dir(cfg: JobConfig, command: str, reads: dict[str, str],
                  needs_init: bool = False) -> None:  # fmt: skip
    """run.dir is this job's own: not a run directory the job reads (post.init, a teacher),
    whose config, metrics and checkpoints it would write over, and not a run of another
    command (or a pre-training run), which it would resume from and append to. post.init
    must have a checkpoint unless the job resumes from its own (`needs_init`: always)."""
    out = Path(cfg.run.dir)
    for role, run_dir in reads.items():
        if run_dir and Path(run_dir).resolve() == out.resolve():
            raise ValueError(f"run.dir={cfg.run.dir} is also {role}: the job would "
                             "write its config, metrics and checkpoints over the run it reads; "
                             "set run.dir to a new directory")  # fmt: skip
    if (out / "config.toml").is_file() or (out / COMMAND_FILE).is_file():
        try:
            made_by = (out / COMMAND_FILE).read_text().strip()
        except OSError:
            made_by = None
        if made_by is None:
            try:
                init = tomllib.loads((out / "config.toml").read_text()).get("post", {}).get("init")
            except (OSError, ValueError):
                init = None
            if not init:  # `wanka train` and `wanka import` write post.init = ""
                raise ValueError(f"run.dir={cfg.run.dir} holds a run that is not post-training "
                                 "(e.g. `wanka train`): this job would resume from its "
                                 "checkpoints and rewrite its metrics; set run.dir to a new "
                                 "directory")  # fmt: skip
        elif made_by != command:
            raise ValueError(f"run.dir={cfg.run.dir} holds a `wanka {made_by}` run: "
                             f"`wanka {command}` would resume from its checkpoints and append "
                             "to its metrics; set run.dir to a new directory")  # fmt: skip
    if needs_init or not complete_checkpoints(out / "checkpoints"):
        check_has_checkpoint(cfg.post.init, "post.init")


def check_length(longest_prompt: int, completion_tokens: int, model: ModelConfig,
                 role: str) -> None:  # fmt: skip
    """Prompt + completion must fit the model's position table (checked for every prompt
    before training, not when a long one is drawn hours in)."""
    if longest_prompt + completion_tokens > model.max_seq_len:
        raise ValueError(f"{role}: the longest prompt ({longest_prompt} tokens) + "
                         f"post.completion_tokens ({completion_tokens}) exceeds its max_seq_len "
                         f"{model.max_seq_len}: shorten the prompts or post.completion_tokens")  # fmt: skip
