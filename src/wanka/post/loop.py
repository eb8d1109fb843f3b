"""The post-training loop `wanka distill`, `rl` and `sft` share: steps, held-out evals,
checkpoints and metrics. Each command supplies one step and one eval function."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from wanka.post.engine import zero_routing_counts
from wanka.post.job import PostJob
from wanka.post.rollout import Samples
from wanka.resilience.snapshot import capture
from wanka.resilience.worker import Preempted
from wanka.train.optim import clip_grad_norm, set_lr
from wanka.train.trainer import state_digest

log = logging.getLogger("wanka.post")

# A step yields one loss per optimizer update on its batch (GRPO may update several times on
# one batch of samples; distillation once), and fills its metrics dict as it goes.
Step = Callable[[PostJob, int], tuple[Iterator[torch.Tensor], dict[str, float]]]
Eval = Callable[[PostJob, int], dict[str, float]]


def run(job: PostJob, step_fn: Step, evaluate: Eval) -> dict[str, float]:
    """Train from job.start_step to train.steps; returns the last eval."""
    cfg = job.cfg
    start = job.start_step
    if start > cfg.train.steps:
        raise ValueError(f"{job.run_dir} is already at step {start} but train.steps="
                         f"{cfg.train.steps}: raise train.steps to go on, or use a new run.dir")  # fmt: skip
    rt = job.runtime
    if start == 0:
        with rt.span("eval", step=0), rt.phase("eval", 0):
            first = evaluate(job, 0)
        job.metrics.log_eval(0, first)
    result: dict[str, float] = {}
    params = list(job.policy.parameters())
    # Under HSDP a replica holds every gradient element once: the norm sums over one replica.
    shard = job.dims.mesh("shard").get_group() if job.dims.hsdp_enabled else None
    for step in range(start, cfg.train.steps):
        # Timeline spans as in pre-training (train/trainer.py), so `wanka report`'s goodput
        # block counts post-training steps: the step span is the whole iteration, its
        # snapshot nested inside; eval and checkpoint spans follow it.
        with rt.span("step", step=step) as span:
            stop = rt.stop_before_step(step, span)  # everyone stops here, together
            if not stop:
                _step(job, step, step_fn, params, shard)
                if job.snapshots is not None and (step + 1) % cfg.resilience.snapshot_every == 0:
                    with rt.span("snapshot", step=step), rt.phase("snapshot", step):
                        job.snapshots.save(step + 1, capture(job.policy, job.optimizer,
                                                             job.records()))  # fmt: skip
        if stop:
            _last_gasp(job, step)
        last = step + 1 == cfg.train.steps
        if (step + 1) % cfg.train.eval_every == 0 or last:
            with rt.span("eval", step=step), rt.phase("eval", step):
                result = evaluate(job, step + 1)
            job.metrics.log_eval(step + 1, result)
        if cfg.checkpoint.enable and ((step + 1) % cfg.checkpoint.every == 0 or last):
            with (rt.span("checkpoint", step=step) as ck_span, rt.phase("checkpoint", step),
                  job.ckpt.report(rt.event, rt.node, ck_span)):  # fmt: skip
                job.ckpt.save(step + 1, job.train_state(), must_succeed=last)
    if start == cfg.train.steps:  # finished already (a rerun): report where it stands
        with rt.span("eval", step=start), rt.phase("eval", start):
            result = evaluate(job, start)
    job.ckpt.wait()
    if job.snapshots is not None:
        job.snapshots.close(discard=True)  # finished: nothing left to recover from memory
    # Two runs with equal digests ended in bitwise-identical states (fault drills compare).
    result = {**result, "state_digest": state_digest(job.policy, job.optimizer)}
    job.metrics.close()
    rt.progress.close()
    dist.barrier()  # leave together: a rank tearing its group down early gets rank 0 killed
    return result


def _step(job: PostJob, step: int, step_fn: Step, params: list, shard) -> None:
    """One optimizer step (or several on one batch: GRPO) and its metrics row."""
    cfg, rt = job.cfg, job.runtime
    t0 = time.perf_counter()
    lr = set_lr(job.optimizer, step, cfg.train)
    rt.progress.enter("forward", step)  # sampling included: it is the policy's forward
    losses, m = step_fn(job, step)
    for loss in losses:
        rt.progress.enter("backward", step)
        loss.backward()
        rt.progress.enter("optimizer", step)
        grad_norm = clip_grad_norm(params, cfg.train.grad_clip, group=shard)
        if torch.isfinite(grad_norm):
            job.optimizer.step()
        else:  # one bad batch (say, a teacher's overflow) must not poison the weights
            log.warning("step %d: non-finite gradient norm; update skipped", step + 1)
        job.optimizer.zero_grad(set_to_none=True)
        zero_routing_counts(job.policy)
    m.update(grad_norm=float(grad_norm), lr=lr, step_time=time.perf_counter() - t0)
    job.metrics.log_train(step + 1, m)


def _last_gasp(job: PostJob, step: int) -> None:
    """Stop on request: a checkpoint of the state after `step` steps, then leave (exit 75)."""
    rt = job.runtime
    with (rt.span("last_gasp", step=step), rt.phase("checkpoint", step),
          job.ckpt.report(rt.event, rt.node)):  # fmt: skip
        if job.snapshots is not None:
            job.snapshots.wait()
        if job.cfg.checkpoint.enable and step > job.start_step:
            job.ckpt.save(step, job.train_state())  # must succeed: else exit 2 with the reason
    job.metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    raise Preempted(f"stopped on request at step {step}")


def global_sum(*values: float) -> list[float]:
    """Sums over every rank (float64), e.g. token counts that normalise a loss."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def global_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def regularisers(job: PostJob, parts, s: Samples) -> torch.Tensor:
    """What pre-training also optimises besides the LM loss, on the same scale: the indexer's
    KL to the main attention (so DSA keeps selecting well as the weights move) and the MoE
    balance losses."""
    m = job.cfg.model
    n_indexers = sum(blk.attention.indexer is not None for blk in job.policy.layers.values())
    (tokens,) = global_sum(float(s.tokens.numel()))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (parts.kl_sum / max(tokens * n_indexers, 1)
            + m.balance_loss_weight * parts.balance / world
            + m.seq_balance_loss_weight * parts.seq_balance / world)  # fmt: skip


def per_domain(values: torch.Tensor, mask: torch.Tensor, row_domains: list[str],
               names: list[str]) -> dict[str, float]:  # fmt: skip
    """Mean of per-token `values` over the masked tokens of each domain, over all ranks."""
    sums = []
    for d in names:
        rows = torch.tensor([x == d for x in row_domains], device=values.device)
        sel = mask & rows[:, None]
        sums += [float(values[sel].sum()), float(sel.sum())]
    totals = global_sum(*sums)
    return {d: totals[2 * i] / max(totals[2 * i + 1], 1) for i, d in enumerate(names)}


def chunks(job: PostJob, items: list) -> list[list]:
    """This rank's share of `items` in rounds of prompts_per_step; every rank gets the same
    number of rounds (possibly empty), since each round runs sharded forwards together."""
    per, dp = job.cfg.post.prompts_per_step, job.dims.dp
    rounds = -(-len(items) // (per * dp))
    return [items[(r * dp + job.dp_rank) * per : (r * dp + job.dp_rank + 1) * per]
            for r in range(rounds)]  # fmt: skip
