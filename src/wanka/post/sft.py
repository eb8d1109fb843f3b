"""`wanka sft`: supervised fine-tuning on tagged prompts, cross-entropy on completion tokens.

The completions are either the corpus's own continuations (post.sft_source="reference": e.g.
a domain teacher made from a base run with post.domains="code") or samples of each prompt's
domain teacher (post.sft_source="teachers": sequence-level distillation, the off-policy
baseline that on-policy distillation is measured against). Teachers sample from an unsharded
copy on each rank (the same decoder as every other sampling path), taken once: they are frozen.
"""

from __future__ import annotations

from wanka.config.schema import JobConfig
from wanka.infer.generate import Generator
from wanka.infer.sampling import Sampling
from wanka.post.checks import check_common, check_run_dir, check_teachers, parse_teachers
from wanka.post.distill import Teachers, held_out_loss
from wanka.post.engine import Rollout, run_config
from wanka.post.job import PostJob, collected, setup
from wanka.post.loop import global_max, global_sum, per_domain, regularisers, run
from wanka.post.losses import token_logprobs
from wanka.post.prompts import TaggedPrompt, domains
from wanka.post.rollout import assemble, row_length


def check_sft(cfg: JobConfig) -> None:
    """Settings that cannot work together, refused before any rank starts."""
    p = cfg.post
    if not p.init:
        raise ValueError("post.init is empty: name the run directory (a finished `wanka train` "
                         "run) to fine-tune")  # fmt: skip
    on_references = "post.sft_source='reference'" if p.sft_source == "reference" else ""
    used = check_common(cfg, samples_from_policy=p.sft_source == "teachers",
                        references_for=on_references)  # fmt: skip
    run_config(p.init, "post.init")
    teachers = parse_teachers(p.teachers) if p.sft_source == "teachers" else {}
    check_run_dir(cfg, "sft", {"post.init": p.init} | {f"the teacher for {d!r}": r
                                                       for d, r in teachers.items()})  # fmt: skip
    if teachers:
        check_teachers(cfg, teachers, used)


class TeacherSamples:
    """Completions drawn from each prompt's domain teacher."""

    def __init__(self, job: PostJob, teachers: Teachers) -> None:
        self.copies: dict[str, Rollout] = {}
        for domain, model in teachers.models.items():
            copy = Rollout(teachers.configs[domain], job.device)
            copy.sync(model)  # every rank, same order: an all-gather over the teacher's meshes
            self.copies[domain] = copy
        self.job = job

    def __call__(self, prompts: list[TaggedPrompt], tokens: list[list[int]], step: int
                 ) -> list[list[int]]:  # fmt: skip
        p, job = self.job.cfg.post, self.job
        out: list[list[int]] = [[] for _ in prompts]
        for i, (domain, copy) in enumerate(sorted(self.copies.items())):
            rows = [j for j, x in enumerate(prompts) if x.domain == domain]
            if not rows:
                continue
            seed = hash((job.cfg.train.seed, step, job.rank, i)) % 2**31
            gen = Generator(
                copy.model,
                Sampling(p.temperature, p.top_p),
                seed=seed,
                vocab=job.tokenizer.vocab_size,
            )
            for j, completion in zip(rows, gen.generate([tokens[j] for j in rows],
                                                        p.completion_tokens)):  # fmt: skip
                out[j] = completion or [0]
        return out


def make_step(teacher_samples: TeacherSamples | None):
    def step_loss(job: PostJob, step: int):
        C = job.cfg.post.completion_tokens
        prompts = job.prompts_for(step)
        tokens = [job.encode(x.text) for x in prompts]
        if teacher_samples is None:
            completions = [job.encode(x.reference)[:C] or [0] for x in prompts]
        else:
            completions = teacher_samples(prompts, tokens, step)
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        (n,) = global_sum(float(s.n_tokens))
        parts = job.policy(s.tokens, s.positions, s.doc_ids, s.no_labels, return_logits=True)
        nll = -token_logprobs(parts.logits, s.targets) * s.mask
        nll_sum = nll.sum()
        loss = nll_sum / max(n, 1.0) + regularisers(job, parts, s)
        row_domains = [x.domain for x in prompts]
        by_domain = per_domain(nll.detach(), s.mask, row_domains, domains(job.train_prompts))
        # Compute spent in forward-token equivalents, as `wanka distill` counts it: the
        # student's forward and backward (3 x), plus each token a teacher sampled.
        total = sum(len(t) + len(c) for t, c in zip(tokens, completions))
        sampled = sum(map(len, completions)) if teacher_samples is not None else 0
        ce, processed = global_sum(float(nll_sum.detach()), float(total * 3 + sampled))
        m = {"loss": ce / max(n, 1.0), "tokens_processed": processed, "completion_tokens": n}
        m.update({f"train_loss/{d}": v for d, v in by_domain.items()})
        return iter([loss]), m

    return step_loss


@collected
def main(cfg: JobConfig) -> dict[str, float]:
    check_sft(cfg)
    job = setup(cfg, "sft")
    if cfg.post.sft_source == "reference" and not all(x.reference for x in job.train_prompts):
        raise ValueError(f"post.sft_source='reference' trains on the prompts' continuations, but "
                         f"some prompts in {cfg.post.prompts} have no 'reference': add them, or "
                         "set post.sft_source='teachers'")  # fmt: skip
    samples = TeacherSamples(job, Teachers(job)) if cfg.post.sft_source == "teachers" else None
    names = domains(job.val_prompts)

    def evaluate(job: PostJob, step: int) -> dict[str, float]:
        return {f"val_loss/{d}": v for d, v in held_out_loss(job, job.policy, names).items()}

    return run(job, make_step(samples), evaluate)
