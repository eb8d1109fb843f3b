"""`wanka draft`: tune a finished run's MTP module(s) to draft for its own main model.

Speculative decoding keeps a draft only when it is the token the main model itself would
choose, so the best drafter is the one that predicts the main model, not the corpus. As EAGLE
and Medusa-2's self-distillation do, the main model is frozen and the MTP modules learn its
own next-token distribution d tokens ahead (KL(main || MTP) per position, exact over the
vocabulary) on text it generated itself from the prompts (the text decoding will meet), the
prompt's corpus tokens included. Held-out evals run real speculative decoding on held-out
prompts and report the acceptance per draft position and the mean acceptance length.
The decoder drafts 2 .. N by running depth 1 again on its own output, which pre-training
never shows it: with post.draft_steps > 1 (default: post.speculate) those steps are trained
too, the text's tokens standing in for the drafts (EAGLE-3's training-time test,
Transformer._recursive_drafts), each against the main model's distribution that far ahead;
the loss is the sum over steps of each step's per-position KL.
The result is a run directory `wanka generate --speculate N` and `wanka bench decode` read.
With model.mtp_depth > 1 every depth is tuned (depth d against the main model d tokens ahead),
but the decoder drafts with depth 1 only (docs/INFERENCE.md).
"""

from __future__ import annotations

import torch

from wanka.config.schema import JobConfig
from wanka.infer.generate import Generator, distinct_4grams
from wanka.infer.sampling import Sampling
from wanka.post.checks import check_common, check_run_dir
from wanka.post.engine import run_config, zero_routing_counts
from wanka.post.job import PostJob, collected, setup
from wanka.post.loop import chunks, global_max, global_sum, run
from wanka.post.rollout import Samples, assemble, row_length


def check_draft(cfg: JobConfig) -> None:
    """Settings that cannot work, refused before any rank starts (cfg holds post.init's model)."""
    run_config(cfg.post.init, "post.init")
    check_common(cfg, samples_from_policy=True)
    if cfg.model.mtp_depth < 1:
        raise ValueError(f"post.init ({cfg.post.init}) has no MTP module (model.mtp_depth = 0): "
                         "`wanka draft` tunes MTP modules; train with model.mtp_depth >= 1")  # fmt: skip
    if cfg.post.speculate < 1:
        raise ValueError(f"post.speculate={cfg.post.speculate}: the held-out evals decode with "
                         "that many drafts per round, 1 or more")  # fmt: skip
    if not 0 <= cfg.post.draft_steps <= cfg.post.completion_tokens:
        raise ValueError(f"post.draft_steps={cfg.post.draft_steps}: drafts per round to train, "
                         f"from 1 to post.completion_tokens ({cfg.post.completion_tokens}); "
                         "0 = post.speculate")  # fmt: skip
    check_run_dir(cfg, "draft", {"post.init": cfg.post.init})


def draft_steps(cfg: JobConfig) -> int:
    return cfg.post.draft_steps or cfg.post.speculate


def row_labels(s: Samples) -> torch.Tensor:
    """Next-token labels of every real token (prompt and completion), -100 elsewhere: which
    positions the MTP loss reads (depth d needs the label d - 1 tokens ahead too)."""
    nxt_real = torch.nn.functional.pad(s.doc_ids[:, 1:] == 0, (0, 1), value=False)
    return torch.where((s.doc_ids == 0) & nxt_real, s.targets, torch.full_like(s.targets, -100))


def kl_terms(job: PostJob, s: Samples) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(KL sum, position count) of each trained draft step on rows s: the first draft (with
    every MTP depth > 1 added in), then the recursive steps 2, 3, ..."""
    parts = job.policy(s.tokens, s.positions, s.doc_ids, row_labels(s), mtp_self=True,
                       draft_steps=draft_steps(job.cfg))  # fmt: skip
    zero_routing_counts(job.policy)
    return [(parts.mtp_sum, parts.mtp_count), *parts.draft_kl]


def kl_names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}mtp_kl"] + [f"{prefix}mtp_kl_step{j}" for j in range(2, n + 1)]


def mtp_losses(job: PostJob, s: Samples) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (the loss: each step's KL sum over its position count on all ranks, summed over
    steps; the per-position KL of each step, all ranks, and their sum as "loss")."""
    terms = kl_terms(job, s)
    totals = global_sum(*(float(c) for _, c in terms), *(float(x.detach()) for x, _ in terms))
    n, sums = totals[: len(terms)], totals[len(terms) :]
    loss = sum(x / max(c, 1.0) for (x, _), c in zip(terms, n))
    logged = {k: x / max(c, 1.0) for k, x, c in zip(kl_names("", len(terms)), sums, n)}
    return loss, {"loss": sum(logged.values()), **logged, "mtp_positions": n[0]}


def make_step():
    synced = []  # the main model is frozen: its sampling copy is taken once (a collective)

    def step_loss(job: PostJob, step: int):
        prompts = job.prompts_for(step)
        tokens = [job.encode(x.text) for x in prompts]
        if not synced:
            job.rollout.sync(job.policy)
            synced.append(True)
        completions = job.sample(tokens, step)  # the frozen main model's own text
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        loss, logged = mtp_losses(job, s)
        total = sum(len(t) + len(c) for t, c in zip(tokens, completions))
        (processed,) = global_sum(float(total))
        return iter([loss]), {**logged, "row_tokens": processed}

    return step_loss


@torch.no_grad()
def held_out_acceptance(job: PostJob) -> dict[str, float]:
    """Speculative decoding (post.speculate drafts per round) of every held-out prompt with the
    current MTP weights, sampled as the training text is (post.temperature / top_p, seeded the
    same at every eval; speculative sampling keeps a draft with probability min(1, p / q)):
    acceptance per draft position, mean acceptance length and the completions' share of
    distinct 4-grams, over all ranks. Sampled, not greedy: a weak model's greedy text
    collapses into loops that any drafter predicts (docs/BENCHMARKS.md, "tuned as a drafter")."""
    if not job.val_prompts:  # post.eval_prompts = 0 with a JSONL file: nothing to decode
        return {}
    job.rollout.sync(job.policy)
    p = job.cfg.post
    drafted, accepted, rounds, kept = [0] * p.speculate, [0] * p.speculate, 0, 0
    grams = [0.0, 0.0]
    for r, chunk in enumerate(chunks(job, job.val_prompts)):
        if not chunk:
            continue
        gen = Generator(job.rollout.model, Sampling(p.temperature, p.top_p),
                        speculate=p.speculate, seed=1000 * job.rank + r,
                        vocab=job.tokenizer.vocab_size)  # fmt: skip
        outs = gen.generate([job.encode(x.text) for x in chunk], p.completion_tokens)
        drafted = [a + b for a, b in zip(drafted, gen.stats.drafted)]
        accepted = [a + b for a, b in zip(accepted, gen.stats.accepted)]
        rounds, kept = rounds + gen.stats.rounds, kept + gen.stats.kept
        share = distinct_4grams(outs)
        if share is not None:
            grams = [grams[0] + share * len(outs), grams[1] + len(outs)]
    totals = global_sum(*drafted, *accepted, float(rounds), float(kept), *grams)
    k = p.speculate
    out = {f"val_acceptance/draft{j + 1}": totals[k + j] / max(totals[j], 1) for j in range(k)}
    # Output tokens per round as kept (after the completion_tokens / EOS cut), as generate says.
    out["val_mean_acceptance_length"] = totals[2 * k + 1] / totals[2 * k] if totals[2 * k] else 1.0
    if totals[-1]:
        out["val_distinct_4grams"] = totals[-2] / totals[-1]
    return out


@torch.no_grad()
def held_out_kl(job: PostJob) -> dict[str, float]:
    """KL(main || MTP) per position on the held-out prompts' corpus continuations (none when
    the prompts come without a reference)."""
    C = job.cfg.post.completion_tokens
    steps = draft_steps(job.cfg)
    sums = [0.0] * (2 * steps)  # KL sums, then counts, per step
    scored = [x for x in job.val_prompts if x.reference]
    if not scored:
        return {}
    job.policy.eval()
    for chunk in chunks(job, scored):
        rows = chunk or scored[:1]  # an empty round still joins the collectives
        s = assemble([job.encode(x.text) for x in rows],
                     [job.encode(x.reference)[:C] or [0] for x in rows], job.device)  # fmt: skip
        terms = kl_terms(job, s)
        if chunk:
            for j, (x, c) in enumerate(terms):
                sums[j] += float(x)
                sums[steps + j] += float(c)
    job.policy.train()
    totals = global_sum(*sums)
    return {k: totals[j] / max(totals[steps + j], 1.0)
            for j, k in enumerate(kl_names("val_", steps))}  # fmt: skip


@collected
def main(cfg: JobConfig) -> dict[str, float]:
    check_draft(cfg)
    job = setup(cfg, "draft")
    p = cfg.post
    if job.longest_prompt + p.completion_tokens + p.speculate > cfg.model.max_seq_len:
        raise ValueError(f"post.init: the longest prompt ({job.longest_prompt} tokens) + "
                         f"post.completion_tokens ({p.completion_tokens}) + post.speculate "
                         f"({p.speculate}) exceeds its max_seq_len {cfg.model.max_seq_len}: "
                         "shorten the prompts or post.completion_tokens")  # fmt: skip

    def evaluate(job: PostJob, step: int) -> dict[str, float]:
        return {**held_out_kl(job), **held_out_acceptance(job)}

    return run(job, make_step(), evaluate)
