"""`wanka draft`: tune a finished run's MTP module(s) to draft for its own main model.

Speculative decoding keeps a draft only when it is the token the main model itself would
choose, so the best drafter is the one that predicts the main model, not the corpus. As EAGLE
and Medusa-2's self-distillation do, the main model is frozen and the MTP modules learn its
own next-token distribution d tokens ahead (KL(main || MTP) per position, exact over the
vocabulary) on text it generated itself from the prompts (the text decoding will meet), the
prompt's corpus tokens included. Held-out evals run real speculative decoding on held-out
prompts and report the acceptance per draft position and the mean acceptance length.
The result is a run directory `wanka generate --speculate N` and `wanka bench decode` read.
"""

from __future__ import annotations

import torch

from wanka.config.schema import JobConfig
from wanka.infer.generate import Generator
from wanka.post.checks import check_common
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


def row_labels(s: Samples) -> torch.Tensor:
    """Next-token labels of every real token (prompt and completion), -100 elsewhere: which
    positions the MTP loss reads (depth d needs the label d - 1 tokens ahead too)."""
    nxt_real = torch.nn.functional.pad(s.doc_ids[:, 1:] == 0, (0, 1), value=False)
    return torch.where((s.doc_ids == 0) & nxt_real, s.targets, torch.full_like(s.targets, -100))


def make_step():
    def step_loss(job: PostJob, step: int):
        prompts = job.prompts_for(step)
        tokens = [job.encode(x.text) for x in prompts]
        job.rollout.sync(job.policy)  # a collective: every rank, every step
        completions = job.sample(tokens, step)  # the frozen main model's own text
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        parts = job.policy(s.tokens, s.positions, s.doc_ids, row_labels(s), mtp_self=True)
        zero_routing_counts(job.policy)
        n, kl = global_sum(float(parts.mtp_count), float(parts.mtp_sum.detach()))
        loss = parts.mtp_sum / max(n, 1.0)
        total = sum(len(t) + len(c) for t, c in zip(tokens, completions))
        (processed,) = global_sum(float(total))
        return iter([loss]), {"loss": kl / max(n, 1.0), "mtp_positions": n,
                              "tokens": processed}  # fmt: skip

    return step_loss


@torch.no_grad()
def held_out_acceptance(job: PostJob) -> dict[str, float]:
    """Greedy speculative decoding (post.speculate drafts per round) of every held-out prompt
    with the current MTP weights: acceptance per draft position and mean acceptance length,
    over all ranks. Greedy output equals plain decoding's whatever the drafts (tested in
    tests/unit/test_decode.py), so only the speed depends on them."""
    if not job.val_prompts:  # post.eval_prompts = 0 with a JSONL file: nothing to decode
        return {}
    job.rollout.sync(job.policy)
    p = job.cfg.post
    drafted, accepted, rounds = [0] * p.speculate, [0] * p.speculate, 0
    for chunk in chunks(job, job.val_prompts):
        if not chunk:
            continue
        gen = Generator(job.rollout.model, speculate=p.speculate)  # greedy
        gen.generate([job.encode(x.text) for x in chunk], p.completion_tokens)
        drafted = [a + b for a, b in zip(drafted, gen.stats.drafted)]
        accepted = [a + b for a, b in zip(accepted, gen.stats.accepted)]
        rounds += gen.stats.rounds
    totals = global_sum(*drafted, *accepted, float(rounds))
    k = p.speculate
    out = {f"val_acceptance/draft{j + 1}": totals[k + j] / max(totals[j], 1) for j in range(k)}
    out["val_mean_acceptance_length"] = 1.0 + sum(totals[k : 2 * k]) / max(totals[-1], 1)
    return out


@torch.no_grad()
def held_out_kl(job: PostJob) -> dict[str, float]:
    """KL(main || MTP) per position on the held-out prompts' corpus continuations (none when
    the prompts come without a reference)."""
    C = job.cfg.post.completion_tokens
    sums = [0.0, 0.0]
    scored = [x for x in job.val_prompts if x.reference]
    if not scored:
        return {}
    job.policy.eval()
    for chunk in chunks(job, scored):
        rows = chunk or scored[:1]  # an empty round still joins the collectives
        s = assemble([job.encode(x.text) for x in rows],
                     [job.encode(x.reference)[:C] or [0] for x in rows], job.device)  # fmt: skip
        parts = job.policy(s.tokens, s.positions, s.doc_ids, row_labels(s), mtp_self=True)
        zero_routing_counts(job.policy)
        if chunk:
            sums[0] += float(parts.mtp_sum)
            sums[1] += float(parts.mtp_count)
    job.policy.train()
    kl, n = global_sum(*sums)
    return {"val_mtp_kl": kl / max(n, 1.0)}


@collected
def main(cfg: JobConfig) -> dict[str, float]:
    check_draft(cfg)
    job = setup(cfg, "draft")

    def evaluate(job: PostJob, step: int) -> dict[str, float]:
        return {**held_out_kl(job), **held_out_acceptance(job)}

    return run(job, make_step(), evaluate)
