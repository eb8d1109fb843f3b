"""`wanka distill`: multi-teacher on-policy distillation (MOPD).

Each step the student samples completions of its prompts (on-policy; or, with probability
1 - post.on_policy_fraction, takes the corpus continuation, as GKD mixes in fixed data); the
teacher of each prompt's domain scores every completion token; the loss is the per-token
divergence between the two next-token distributions over the completion, by default the
reverse KL(student || teacher): dense feedback on exactly the mistakes the student makes.
"""

from __future__ import annotations

import math
import random
import sys

import torch

from wanka.config.schema import JobConfig, ModelConfig
from wanka.post.checks import (
    check_common,
    check_length,
    check_run_dir,
    check_teachers,
    check_vocabulary,
    parse_teachers,
)
from wanka.post.engine import build_sharded, frozen, load_weights, run_config, zero_routing_counts
from wanka.post.job import PostJob, collected, setup
from wanka.post.loop import chunks, global_max, global_sum, per_domain, regularisers, run
from wanka.post.losses import (
    forward_kl,
    generalized_jsd,
    reverse_kl_exact,
    reverse_kl_sampled,
    token_logprobs,
)
from wanka.post.origin import run_identity
from wanka.post.prompts import TaggedPrompt, domains
from wanka.post.rollout import Samples, assemble, row_length


def check_distill(cfg: JobConfig) -> None:
    """Settings that cannot work together, refused before any rank starts."""
    p = cfg.post
    if not p.init:
        raise ValueError("post.init is empty: name the student's run directory (a finished "
                         "`wanka train` run) to distill into")  # fmt: skip
    off_policy = (
        f"post.on_policy_fraction={p.on_policy_fraction}" if p.on_policy_fraction < 1 else ""
    )
    used = check_common(
        cfg, samples_from_policy=p.on_policy_fraction > 0, references_for=off_policy
    )
    run_config(p.init, "post.init")
    teachers = parse_teachers(p.teachers)  # each used one is checked by check_teachers
    if p.estimator == "sampled":
        if p.divergence != "reverse_kl":
            raise ValueError("post.estimator='sampled' estimates the reverse KL only: set "
                             "post.divergence='reverse_kl' or post.estimator='exact'")  # fmt: skip
        if p.on_policy_fraction != 1.0 or p.temperature != 1.0 or p.top_p != 1.0:
            raise ValueError("post.estimator='sampled' is unbiased only for tokens the student "
                             "samples itself at temperature 1: set post.on_policy_fraction=1, "
                             "post.temperature=1, post.top_p=1, or post.estimator='exact'")  # fmt: skip
    if not 0.0 <= p.on_policy_fraction <= 1.0 or not 0.0 <= p.beta <= 1.0:
        raise ValueError("post.on_policy_fraction and post.beta are fractions in [0, 1]")
    check_run_dir(cfg, "distill", {"post.init": p.init} | {f"the teacher for {d!r}": r
                                                           for d, r in teachers.items()})  # fmt: skip
    check_teachers(cfg, teachers, used)
    check_not_the_student(cfg, teachers, used)


def check_not_the_student(cfg: JobConfig, teachers: dict[str, str], used: list[str]) -> None:
    """A teacher that is post.init's own checkpoint (the same run directory, or a copy) starts
    equal to the student: every divergence, and its gradient, is 0, so its domain has nothing
    to learn. Every teacher so: refused (the job would only spend compute). Some: said once,
    before any rank starts, since that is a use (a teacher per domain the student already
    masters keeps it from drifting there while the others teach it) but also a likely mistake."""
    start = run_identity(cfg.post.init)
    same = [d for d in used if d in teachers and run_identity(teachers[d])[1] == start[1]]
    if not same:
        return
    if len(same) == len(used):
        which = f"the teacher for {same[0]!r} is" if len(same) == 1 else "every teacher is"
        raise ValueError(f"post.teachers: {which} post.init's own checkpoint ({start[0]}): the "
                         "student starts equal to it (divergence 0, gradient 0) and learns "
                         "nothing; name a teacher trained further (e.g. a `wanka sft` of "
                         "post.init on the domain)")  # fmt: skip
    from wanka.distributed.launch import inside_torchrun

    if not inside_torchrun():  # once: the ranks run this check again
        which = ("the teacher for " if len(same) == 1 else "the teachers for ") + ", ".join(
            map(repr, same)) + (" is" if len(same) == 1 else " are")  # fmt: skip
        print(f"wanka distill: note: {which} post.init's own checkpoint ({start[0]}): its "
              "divergence starts at 0, so those prompts only keep the student near its start",
              file=sys.stderr)  # fmt: skip


class Teachers:
    """One frozen, sharded model per domain, scored in the same order on every rank."""

    def __init__(self, job: PostJob) -> None:
        self.models: dict[str, torch.nn.Module] = {}
        self.configs: dict[str, ModelConfig] = {}  # each teacher's own (may be larger)
        used = set(domains(job.train_prompts + job.val_prompts))  # post.domains may drop some
        for domain, run_dir in sorted(parse_teachers(job.cfg.post.teachers).items()):
            if domain not in used:
                continue
            role = f"teacher for {domain!r}"
            tcfg = run_config(run_dir, role)
            check_vocabulary(job.cfg, tcfg, run_dir, role)
            check_length(job.longest_prompt, job.cfg.post.completion_tokens, tcfg.model,
                         f"{role} ({run_dir})")  # fmt: skip
            model = build_sharded(tcfg.model, job.dims, job.device, job.cfg.train.seed,
                                  job.param_dtype)  # fmt: skip
            load_weights(model, run_dir, role)
            self.models[domain] = frozen(model)
            self.configs[domain] = tcfg.model
        missing = sorted(set(domains(job.train_prompts)) - set(self.models))
        if missing:
            raise ValueError(f"post.teachers has no teacher for prompt domain(s) {missing}: "
                             "add DOMAIN=RUN_DIR for each")  # fmt: skip

    @torch.no_grad()
    def logits(self, s: Samples, row_domains: list[str]) -> torch.Tensor:
        """[B, L, V] fp32: each row scored by its domain's teacher."""
        out = None
        for domain, model in self.models.items():
            rows = [i for i, d in enumerate(row_domains) if d == domain]
            idx = torch.tensor(rows or [0], device=s.tokens.device)  # [0]: collectives still run
            parts = model(s.tokens[idx], s.positions[idx], s.doc_ids[idx], s.no_labels[idx],
                          return_logits=True)  # fmt: skip
            zero_routing_counts(model)
            if out is None:
                out = parts.logits.new_zeros((*s.tokens.shape, parts.logits.shape[-1]),
                                             dtype=torch.float32)  # fmt: skip
            if rows:
                out[idx] = parts.logits.float()
        return out


def divergence(job: PostJob, student: torch.Tensor, teacher: torch.Tensor, s: Samples):
    p = job.cfg.post
    if p.divergence == "forward_kl":
        return forward_kl(student, teacher, s.mask)
    if p.divergence == "jsd":
        return generalized_jsd(student, teacher, s.mask, p.beta)
    if p.estimator == "sampled":
        return reverse_kl_sampled(student, teacher, s.targets, s.mask)
    return reverse_kl_exact(student, teacher, s.mask)


def _completions(job: PostJob, prompts: list[TaggedPrompt], tokens: list[list[int]],
                 step: int) -> tuple[list[list[int]], bool]:  # fmt: skip
    """(completions, on-policy?): the same coin on every rank, drawn from the seed and step."""
    p = job.cfg.post
    on_policy = random.Random(job.cfg.train.seed * 1_000_003 + step).random() < p.on_policy_fraction
    if not on_policy:
        return [job.encode(x.reference)[: p.completion_tokens] or [0] for x in prompts], False
    job.rollout.sync(job.policy)
    return job.sample(tokens, step), True


def make_step(teachers: Teachers):
    def step_loss(job: PostJob, step: int):
        prompts = job.prompts_for(step)
        tokens = [job.encode(x.text) for x in prompts]
        completions, on_policy = _completions(job, prompts, tokens, step)
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        (n,) = global_sum(float(s.n_tokens))
        parts = job.policy(s.tokens, s.positions, s.doc_ids, s.no_labels, return_logits=True)
        row_domains = [x.domain for x in prompts]
        div_sum, per_token = divergence(job, parts.logits, teachers.logits(s, row_domains), s)
        loss = div_sum / max(n, 1.0) + regularisers(job, parts, s)
        names = sorted(teachers.models)
        by_domain = per_domain(per_token, s.mask, row_domains, names)
        total = sum(len(t) + len(c) for t, c in zip(tokens, completions))
        # Compute spent in forward-token equivalents: the student's forward and backward
        # (3 x), the teacher's forward, each sampled token.
        sampled = sum(map(len, completions)) if on_policy else 0
        div, processed = global_sum(float(div_sum.detach()), float(total * 4 + sampled))
        m = {"loss": div / max(n, 1.0), "on_policy": float(on_policy),
             "tokens_processed": processed, "completion_tokens": n}  # fmt: skip
        m.update({f"divergence/{d}": v for d, v in by_domain.items()})
        return iter([loss]), m

    return step_loss


@torch.no_grad()
def held_out_loss(job: PostJob, model: torch.nn.Module, names: list[str]) -> dict[str, float]:
    """Nats per token of the corpus continuation of each held-out prompt, per domain."""
    C = job.cfg.post.completion_tokens
    sums = {d: [0.0, 0.0] for d in names}
    was_training = model.training
    model.eval()
    scored = [x for x in job.val_prompts if x.reference]  # JSONL prompts may have none
    if not scored:
        return {}
    for chunk in chunks(job, scored):
        rows = chunk or scored[:1]  # an empty round still joins the collectives
        s = assemble([job.encode(x.text) for x in rows],
                     [job.encode(x.reference)[:C] or [0] for x in rows], job.device)  # fmt: skip
        parts = model(s.tokens, s.positions, s.doc_ids, s.no_labels, return_logits=True)
        nll = -token_logprobs(parts.logits, s.targets)
        zero_routing_counts(model)
        for b, x in enumerate(chunk):
            sums[x.domain][0] += float(nll[b][s.mask[b]].sum())
            sums[x.domain][1] += float(s.mask[b].sum())
    model.train(was_training)
    totals = global_sum(*(v for d in names for v in sums[d]))
    return {d: totals[2 * i] / max(totals[2 * i + 1], 1) for i, d in enumerate(names)}


@torch.no_grad()
def held_out_reverse_kl(job: PostJob, teachers: Teachers, names: list[str]) -> dict[str, float]:
    """Per domain: exact KL(student || the domain's teacher) per token of the student's own
    completions of the held-out prompts (one sample each, the same seeds at every eval): what
    on-policy distillation minimises, on prompts it never trained on. The held-out loss
    scores corpus text instead, which off-policy baselines train on directly."""
    names = [d for d in names if d in teachers.models]
    if not job.val_prompts or not names:
        return {}
    job.rollout.sync(job.policy)
    sums = {d: [0.0, 0.0] for d in names}
    was_training = job.policy.training
    job.policy.eval()
    for r, chunk in enumerate(chunks(job, job.val_prompts)):
        rows = chunk or job.val_prompts[:1]  # an empty round still joins the collectives
        tokens = [job.encode(x.text) for x in rows]
        completions = job.sample(tokens, step=-1, salt=r)
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        parts = job.policy(s.tokens, s.positions, s.doc_ids, s.no_labels, return_logits=True)
        zero_routing_counts(job.policy)
        teacher = teachers.logits(s, [x.domain for x in rows])
        _, per_token = reverse_kl_exact(parts.logits, teacher, s.mask)
        for b, x in enumerate(chunk):
            if x.domain not in sums:
                continue  # no teacher for it: nothing to compare with
            sums[x.domain][0] += float(per_token[b][s.mask[b]].sum())
            sums[x.domain][1] += float(s.mask[b].sum())
    job.policy.train(was_training)
    totals = global_sum(*(v for d in names for v in sums[d]))
    return {d: totals[2 * i] / max(totals[2 * i + 1], 1) for i, d in enumerate(names)}


@collected
def main(cfg: JobConfig) -> dict[str, float]:
    check_distill(cfg)
    job = setup(cfg, "distill")
    teachers = Teachers(job)
    names = domains(job.val_prompts)
    if cfg.post.on_policy_fraction < 1 and not all(x.reference for x in job.train_prompts):
        raise ValueError(f"post.on_policy_fraction={cfg.post.on_policy_fraction} trains on the "
                         "prompts' reference continuations, but some prompts in "
                         f"{cfg.post.prompts} have no 'reference': add them, or set "
                         "post.on_policy_fraction=1")  # fmt: skip
    if job.start_step == 0:  # the targets the student is measured against, once
        for d, model in teachers.models.items():
            losses = held_out_loss(job, model, names)
            if not all(math.isfinite(v) for v in losses.values()):  # same on every rank
                raise ValueError(f"the teacher for {d!r} gives a non-finite loss on the "
                                 "held-out prompts: its weights hold NaN/Inf; point "
                                 "post.teachers at a healthy checkpoint")  # fmt: skip
            job.metrics.log_event("teacher_eval", 0, teacher=d, **{f"val_loss/{k}": v
                                                                  for k, v in losses.items()})  # fmt: skip

    def evaluate(job: PostJob, step: int) -> dict[str, float]:
        out = {f"val_loss/{d}": v for d, v in held_out_loss(job, job.policy, names).items()}
        rkl = held_out_reverse_kl(job, teachers, names)
        return out | {f"val_reverse_kl/{d}": v for d, v in rkl.items()}

    return run(job, make_step(teachers), evaluate)
