"""Post-training input checks, run before any rank starts: each refusal is one line naming
the key to change."""

from __future__ import annotations

import dataclasses

from wanka.config.loader import validate
from wanka.config.schema import JobConfig, ModelConfig
from wanka.post.engine import run_config
from wanka.post.prompts import DOMAINS


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
    try:
        validate(dataclasses.replace(cfg, model=model))
    except ValueError as e:
        raise ValueError(f"{role}: {e}") from None


def check_common(cfg: JobConfig, samples_from_policy: bool) -> None:
    p = cfg.post
    positive = {"post.prompts_per_step": p.prompts_per_step,
                "post.completion_tokens": p.completion_tokens, "post.prompt_chars": p.prompt_chars,
                "post.samples_per_prompt": p.samples_per_prompt, "train.eval_every": cfg.train.eval_every}  # fmt: skip
    if cfg.checkpoint.enable:
        positive["checkpoint.every"] = cfg.checkpoint.every
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key}={value}: must be 1 or more")
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


def check_length(longest_prompt: int, completion_tokens: int, model: ModelConfig,
                 role: str) -> None:  # fmt: skip
    """Prompt + completion must fit the model's position table (checked for every prompt
    before training, not when a long one is drawn hours in)."""
    if longest_prompt + completion_tokens > model.max_seq_len:
        raise ValueError(f"{role}: the longest prompt ({longest_prompt} tokens) + "
                         f"post.completion_tokens ({completion_tokens}) exceeds its max_seq_len "
                         f"{model.max_seq_len}: shorten the prompts or post.completion_tokens")  # fmt: skip
