"""`wanka rl`: GRPO with a verifiable reward.

Each step every prompt gets post.samples_per_prompt completions from the current policy; a
reward function scores each; advantages are rewards normalised within the prompt's group (no
value model); the policy follows the clipped-ratio surrogate with a KL penalty to the frozen
initial policy. post.updates_per_batch > 1 takes several optimizer steps on one batch of
samples (PPO epochs): the ratio is then against the sampling policy and the clip bounds how
far the later updates move; with one update the ratio is 1 and the loss is the plain policy
gradient plus the KL term.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch

from wanka.config.schema import JobConfig
from wanka.post.checks import check_common, check_run_dir
from wanka.post.engine import (
    build_sharded,
    frozen,
    load_weights,
    run_config,
    zero_routing_counts,
)
from wanka.post.job import PostJob, collected, setup
from wanka.post.loop import chunks, global_max, global_sum, regularisers, run
from wanka.post.losses import group_advantages, grpo_loss, token_logprobs
from wanka.post.rewards import PYTHON_REWARDS, Reward, kept_as_it_was, load_reward
from wanka.post.rollout import assemble, row_length
from wanka.resilience.heartbeat import USER_CODE, NullReporter


def check_rl(cfg: JobConfig) -> None:
    p = cfg.post
    if not p.init:
        raise ValueError("post.init is empty: name the policy's run directory (a finished "
                         "`wanka train` run) to start from")  # fmt: skip
    run_config(p.init, "post.init")
    check_common(cfg, samples_from_policy=True)
    if p.prompts == "builtin" and p.reward in PYTHON_REWARDS and p.domains.strip():
        if "code" not in {x.strip() for x in p.domains.split(",")}:
            raise ValueError(f"post.domains={p.domains!r}: the built-in reward judges Python, "
                             "so wanka rl uses the code prompts: add code or use post.reward="
                             "package.module:function")  # fmt: skip
    if p.temperature != 1.0 or p.top_p != 1.0:
        raise ValueError("wanka rl samples at temperature 1 and top_p 1: the ratio and the KL "
                         "are computed for the policy's own distribution (set post.temperature"
                         "=1, post.top_p=1)")  # fmt: skip
    if p.updates_per_batch < 1:
        raise ValueError(f"post.updates_per_batch={p.updates_per_batch}: at least 1 update "
                         "per batch of samples")  # fmt: skip
    if p.samples_per_prompt < 2:
        raise ValueError(f"post.samples_per_prompt={p.samples_per_prompt}: GRPO compares "
                         "samples of one prompt with each other, use 2 or more (e.g. 4)")  # fmt: skip
    if p.clip_eps <= 0 or p.kl_coef < 0:
        raise ValueError("post.clip_eps must be > 0 and post.kl_coef >= 0 (e.g. 0.2 and 0.04)")
    if p.kl_coef > MAX_KL_COEF:  # 1e30 overflowed every gradient: each update was skipped
        raise ValueError(f"post.kl_coef={p.kl_coef:g} is above {MAX_KL_COEF:g}: the KL term "
                         "would swamp the reward (and overflow); use e.g. 0.04")  # fmt: skip
    load_reward(p.reward)  # a bad reward spec fails here, in one line, not in every rank
    # post.init is read at every start, resumed or not: the KL reference.
    check_run_dir(cfg, "rl", {"post.init": p.init}, needs_init=True)


log = logging.getLogger("wanka.post.rl")
MAX_KL_COEF = 100.0  # GRPO uses ~0.001-0.1; far above this the reward no longer counts

# Rewards are normalised per group in float64 and the advantages used in float32: a reward
# beyond this is more likely a bug (a sentinel, an overflow) than a score.
REWARD_LIMIT = 1e30


def _rewards(reward: Reward, prompts, texts: list[str], spec: str,
             progress=None) -> torch.Tensor:  # fmt: skip
    """The user's (or a built-in) reward of each completion; anything but a finite number, or
    an exception inside the function, stops the job in one line naming post.reward (the
    exception's traceback goes to the rank's log, with the completion it failed on).
    `progress` (the rank's heartbeat) is in the user_code phase while the function runs: a
    hang or death there is the code's fault, not the node's."""
    values, progress = [], progress or NullReporter()
    with progress.during(USER_CODE):  # the whole batch: a per-call limit would be too tight
        for x, t in zip(prompts, texts):
            values.append(_reward(reward, x, t, spec))
    return torch.tensor(values, dtype=torch.float64)


def _reward(reward: Reward, x, t: str, spec: str) -> float:
    """One completion's reward (see _rewards)."""
    try:
        with kept_as_it_was():
            got = reward(x.text, t, x.domain)
    except (KeyboardInterrupt, GeneratorExit):
        raise  # Ctrl-C is the user's stop, not the reward's fault
    except BaseException as e:  # timeout libraries raise BaseException subclasses too
        log.error(
            "post.reward=%r raised on this completion of a %r prompt:\n%r",
            spec,
            x.domain,
            t[:2000],
            exc_info=True,
            extra={"console": False},
        )  # the log file only: the console gets one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"post.reward={spec!r} raised {type(e).__name__}"
                         f"{': ' + first if first else ''} on a completion of a "
                         f"{x.domain!r} prompt: fix the function (it must return a "
                         "number for any text; its traceback is in RUN_DIR/logs/"
                         "rank*.log)") from None  # fmt: skip
    if inspect.isawaitable(got):  # e.g. a plain function returning an async one's coroutine
        if inspect.iscoroutine(got):
            got.close()  # else "coroutine ... was never awaited" warnings follow the one line
        raise ValueError(f"post.reward={spec!r} returned {got!r:.80}, which is to be awaited, "
                         "not a number: await it inside the function (e.g. asyncio.run) "
                         "and return the number")  # fmt: skip
    if isinstance(got, torch.Tensor):
        got = got.detach()  # a reward computed with autograd: its value is what counts
    try:  # a number: int, float, bool, a numpy or 0-d torch scalar; not the text "0.5"
        r = math.nan if isinstance(got, str | bytes) else float(got)
    except Exception:  # float() runs the value's own code (__float__, a tensor's .item():
        # RuntimeError on a meta tensor): whatever it raises was a traceback, not one line
        r = math.nan
    if not math.isfinite(r) or abs(r) > REWARD_LIMIT:
        raise ValueError(f"post.reward={spec!r} returned {got!r:.80} "
                         f"({type(got).__name__}) for a completion: a reward must be a "
                         f"finite number of magnitude at most {REWARD_LIMIT:g}")  # fmt: skip
    return r


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> int:
    """Groups whose rewards are not all equal: those with nonzero advantages
    (losses.group_advantages), the only ones the policy gradient learns from. A group of all
    successes gives none, as one of all failures, and so does any constant reward."""
    r = rewards.view(-1, group_size)
    return int((r != r[:, :1]).any(dim=1).sum())


def make_step(reference: torch.nn.Module, reward: Reward):
    def step(job: PostJob, step: int):
        p = job.cfg.post
        G = p.samples_per_prompt
        prompts = [x for x in job.prompts_for(step) for _ in range(G)]  # groups are adjacent
        tokens = [job.encode(x.text) for x in prompts]
        job.rollout.sync(job.policy)
        completions = job.sample(tokens, step)
        texts = [job.tokenizer.decode(c) for c in completions]
        rewards = _rewards(reward, prompts, texts, p.reward, job.runtime.progress)
        adv = group_advantages(rewards, G).float().to(job.device)
        s = assemble(tokens, completions, job.device,
                     length=global_max(row_length(tokens, completions)))  # fmt: skip
        (n,) = global_sum(float(s.n_tokens))
        with torch.no_grad():
            ref = reference(s.tokens, s.positions, s.doc_ids, s.no_labels, return_logits=True)
            logp_ref = token_logprobs(ref.logits, s.targets)
            zero_routing_counts(reference)
            # The sampling policy's log-probs (its weights are the policy's before any update
            # on this batch): the ratio of later updates, which the clip bounds, is against it.
            old = None
            if p.updates_per_batch > 1:
                parts = job.policy(s.tokens, s.positions, s.doc_ids, s.no_labels,
                                   return_logits=True)  # fmt: skip
                old = token_logprobs(parts.logits, s.targets)
                zero_routing_counts(job.policy)
        r_sum, r_count, solved, spread = global_sum(
            float(rewards.sum()), float(len(rewards)),
            float((rewards.view(-1, G).max(1).values > 0).sum()),
            float(groups_with_signal(rewards, G)))  # fmt: skip
        # groups_with_signal: the share GRPO learns from; groups_with_a_reward: the share where
        # some sample scored above 0 (for a 0/1 reward, solved at least once in G tries).
        m = {"reward": r_sum / r_count, "groups_with_signal": spread / (r_count / G),
             "groups_with_a_reward": solved / (r_count / G), "completion_tokens": n}  # fmt: skip

        def updates():
            for _ in range(p.updates_per_batch):
                parts = job.policy(s.tokens, s.positions, s.doc_ids, s.no_labels,
                                   return_logits=True)  # fmt: skip
                logp = token_logprobs(parts.logits, s.targets)
                loss_sum, stats = grpo_loss(logp, logp.detach() if old is None else old,
                                            logp_ref, adv, s.mask, p.clip_eps, p.kl_coef)  # fmt: skip
                # The stats are token means on this rank: weight them by its tokens. The last
                # update's values are what is logged.
                names = sorted(stats)
                total, *weighted = global_sum(float(loss_sum.detach()),
                                              *(stats[k] * s.n_tokens for k in names))  # fmt: skip
                m["loss"] = total / max(n, 1.0)
                m.update({k: w / max(n, 1.0) for k, w in zip(names, weighted)})
                yield loss_sum / max(n, 1.0) + regularisers(job, parts, s)

        return updates(), m

    return step


@torch.no_grad()
def held_out_reward(job: PostJob, reward: Reward) -> dict[str, float]:
    """Mean reward of one sampled completion per held-out prompt (a fixed seed per round)."""
    job.rollout.sync(job.policy)
    total = count = 0.0
    for r, chunk in enumerate(chunks(job, job.val_prompts)):
        if not chunk:
            continue  # sampling runs on the rank's own copy: nothing collective to join
        comps = job.sample([job.encode(x.text) for x in chunk], step=-1, salt=r)
        texts = [job.tokenizer.decode(c) for c in comps]
        total += float(
            _rewards(reward, chunk, texts, job.cfg.post.reward, job.runtime.progress).sum()
        )
        count += len(chunk)
    s, n = global_sum(total, count)
    return {"val_reward": s / n} if n else {}  # no held-out prompts: nothing to report


@collected
def main(cfg: JobConfig) -> dict[str, float]:
    check_rl(cfg)
    job = setup(cfg, "rl")
    reward = load_reward(cfg.post.reward)
    reference = build_sharded(job.cfg.model, job.dims, job.device, job.cfg.train.seed,
                              job.param_dtype)  # fmt: skip
    load_weights(reference, cfg.post.init, "post.init (the KL reference)")
    reference = frozen(reference)
    return run(job, make_step(reference, reward), lambda job, step: held_out_reward(job, reward))
