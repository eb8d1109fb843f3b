"""What `wanka distill`, `wanka rl` and `wanka sft` share: process group and meshes, the
policy (from post.init's newest checkpoint), its optimizer and rollout copy, prompts,
checkpoints, metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from wanka.config.loader import save_run_config
from wanka.config.schema import JobConfig
from wanka.data.tokenizer import keep_run_tokenizer, load_tokenizer
from wanka.device import (
    autocast_dtype,
    dist_backend,
    keep_freed_host_memory,
    local_device,
    resolve_device_type,
)
from wanka.distributed.parallel_dims import ParallelDims
from wanka.infer.generate import Generator
from wanka.infer.sampling import Sampling
from wanka.post.checks import COMMAND_FILE, check_length
from wanka.post.engine import (
    Rollout,
    build_sharded,
    chosen_checkpoint,
    forget_checkpoints,
    load_weights,
    run_config,
)
from wanka.post.origin import origin, origin_change
from wanka.post.prompts import (
    DOMAINS,
    TaggedPrompt,
    builtin_prompts,
    domains,
    jsonl_prompts,
    split_held_out,
)
from wanka.post.rewards import PYTHON_REWARDS
from wanka.resilience.snapshot import apply, layout_signature
from wanka.resilience.worker import Runtime
from wanka.train.checkpoint import Checkpointer
from wanka.train.metrics import MetricsWriter
from wanka.train.optim import (
    apply_hyperparameters,
    build_optimizer,
    schedule_change,
    schedule_record,
)
from wanka.train.trainer import setup_logging

log = logging.getLogger("wanka.post")
BUILTIN_POOL_CAP = 2000  # built-in training prompts per domain, at most


@dataclass
class PostJob:
    cfg: JobConfig
    dims: ParallelDims
    device: torch.device
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rollout: Rollout | None  # None for sft: it never samples from the policy
    tokenizer: object
    train_prompts: list[TaggedPrompt]
    val_prompts: list[TaggedPrompt]
    ckpt: Checkpointer
    metrics: MetricsWriter
    rank: int
    dp_rank: int
    run_dir: Path
    start_step: int = 0  # resumed from this run's checkpoint of that step (0: from post.init)
    param_dtype: torch.dtype | None = None  # compute dtype (teachers and reference use it too)
    runtime: Runtime | None = None  # heartbeats and stop requests (wanka/resilience)
    longest_prompt: int = 0  # tokens, over every train and held-out prompt
    snapshots: object = None  # in-memory snapshots (resilience/snapshot.py), when supervised
    # What the run starts from and is measured against (origin.py): kept with its checkpoints.
    origin: dict = dataclasses.field(default_factory=dict)
    # Built-in prompts come in a seeded random order already: the first pass keeps it, so
    # what step s trains on does not depend on train.steps (see prompt_order).
    drawn_in_order: bool = False
    _orders: dict = dataclasses.field(default_factory=dict)  # pass -> prompt order

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prompts_for(self, step: int) -> list[TaggedPrompt]:
        """This rank's prompts of `step`: consecutive slices of the passes over the prompts."""
        n, per = len(self.train_prompts), self.cfg.post.prompts_per_step
        start = (step * self.dims.dp + self.dp_rank) * per
        out = []
        for i in range(start, start + per):
            if i // n not in self._orders:  # one pass at a time is enough
                self._orders = {i // n: prompt_order(n, i // n, self.cfg.train.seed,
                                                     self.drawn_in_order)}  # fmt: skip
            out.append(self.train_prompts[self._orders[i // n][i % n]])
        return out

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def sample(self, prompts: list[list[int]], step: int, salt: int = 0) -> list[list[int]]:
        """The policy's completions (current weights): each rank samples its own prompts with
        its own seed, so that no two ranks draw the same continuations."""
        p = self.cfg.post
        gen = Generator(self.rollout.model, Sampling(p.temperature, p.top_p),
                        seed=hash((self.cfg.train.seed, step, self.rank, salt)) % 2**31,
                        vocab=self.tokenizer.vocab_size)  # fmt: skip
        return gen.generate(prompts, p.completion_tokens)

    def train_state(self) -> dict:
        return {"model_config": json.dumps(dataclasses.asdict(self.cfg.model), sort_keys=True),
                **self.records()}  # fmt: skip

    def records(self) -> dict[str, str]:
        """What a resume compares with its own config, saved with each checkpoint and
        snapshot: the LR schedule in force (a change is reported) and the run's origin (a
        change is refused)."""
        return {"lr_schedule": json.dumps(schedule_record(self.cfg.train), sort_keys=True),
                "post_origin": json.dumps(self.origin, sort_keys=True)}  # fmt: skip


def prompt_order(n: int, k: int, seed: int, drawn_in_order: bool) -> list[int]:
    """Pass k over n training prompts. Each pass is a seeded shuffle, except the first over
    prompts drawn in a seeded random order already (the built-in ones): a longer run draws
    more of the same sequence (its first prompts are the same), so in that pass prompt i is
    the same whatever train.steps sized the pool. Later passes only happen at the pool's cap,
    whose size is fixed too."""
    order = list(range(n))
    if k > 0 or not drawn_in_order:
        random.Random(seed + k).shuffle(order)
    return order


def setup(cfg: JobConfig, command: str) -> PostJob:
    """Process group, meshes, the policy loaded from post.init, prompts; resumes from
    run.dir's newest checkpoint when there is one. `wanka draft` trains the MTP modules only;
    the other commands train everything else."""
    p = cfg.post
    forget_checkpoints()  # which checkpoint post.init and teachers give: chosen afresh per job
    device_type = resolve_device_type(cfg.run.device)
    if device_type == "cpu":  # as `wanka train`: freed blocks stay in the heap
        keep_freed_host_memory()
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device_type))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device(device_type)
    init = run_config(p.init, "post.init")
    cfg = dataclasses.replace(cfg, model=init.model, data=init.data)  # the policy's own
    dims = ParallelDims.from_config(cfg.parallel, world,
                                    int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # fmt: skip
    dims.build_meshes(device_type)
    run_dir = Path(cfg.run.dir)
    setup_logging(run_dir, rank)  # every rank logs to RUN_DIR/logs/rankN.log
    # Heartbeats, stop requests, timeline: the supervisor watches this job as it does training.
    runtime = Runtime(cfg, rank)
    runtime.enable_stack_dumps(run_dir / "logs" / f"rank{rank}.log")
    runtime.chaos.at_start()
    runtime.progress.enter("init")
    if rank == 0:  # which command made the run: another is refused on it (checks.py)
        (run_dir / COMMAND_FILE).write_text(command + "\n")
    torch.manual_seed(cfg.train.seed)
    dtype = autocast_dtype(device_type, cfg.train.mixed_precision)
    policy = build_sharded(cfg.model, dims, device, cfg.train.seed, dtype)
    mtp = {id(x) for x in policy.mtp.parameters()}
    for param in policy.parameters():  # post-training scores the main head only; draft, MTP
        param.requires_grad_((id(param) in mtp) == (command == "draft"))
    optimizer = build_optimizer(policy, cfg.train)
    ckpt = Checkpointer(run_dir / "checkpoints", policy, optimizer, cfg.checkpoint.keep,
                        False, rank == 0)  # fmt: skip
    tokenizer = load_tokenizer(None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer)
    train_prompts, val_prompts = _prompts(cfg, dims.dp, command)
    metrics = MetricsWriter(run_dir, rank == 0, cfg.train.steps, cfg.run.tensorboard)
    rollout = Rollout(cfg.model, device) if command != "sft" else None
    job = PostJob(cfg, dims, device, policy, optimizer, rollout, tokenizer,
                  train_prompts, val_prompts, ckpt, metrics, rank,
                  dims.mesh("dp").get_local_rank(), run_dir)  # fmt: skip
    job.param_dtype, job.runtime = dtype, runtime
    job.drawn_in_order = p.prompts == "builtin"
    # The checkpoints of post.init (rl) and the teachers are chosen here, once for the job
    # (a collective): the record names exactly what the loads below read.
    job.origin = origin(cfg, command, domains(train_prompts + val_prompts), chosen_checkpoint)
    runtime.progress.enter("restore")
    job.longest_prompt = max(len(job.encode(x.text)) for x in train_prompts + val_prompts)
    check_length(job.longest_prompt, p.completion_tokens, cfg.model, "post.init")
    job.snapshots = runtime.snapshot_store(
        world,
        int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        layout_signature(policy, world, job.train_state()["model_config"], _layout_name(dims)),
    )
    with runtime.span("restore"):
        job.start_step, saved = _resume(job, p.init)
    if job.start_step > 0 and "post_origin" not in saved:
        job.drawn_in_order = False  # a run begun before the order changed keeps its shuffle
    if rank == 0:  # only now, as `wanka train` does: a refused resume leaves it as it was
        save_run_config(run_dir, cfg)
        keep_run_tokenizer(cfg.data.tokenizer, run_dir)
    # Rows logged after the checkpoint were lost work; from scratch, every row (step 0 too).
    metrics.truncate_after(job.start_step if job.start_step else -1)
    _note_schedule_change(job, saved.get("lr_schedule"))
    if job.is_main:
        log.info("%s: %d train / %d held-out prompts over domains %s", command,
                 len(train_prompts), len(val_prompts), domains(train_prompts))  # fmt: skip
    return job


def _layout_name(dims: ParallelDims) -> str:
    """How the policy is sharded: a snapshot restores onto the same layout only."""
    name = f"post-dp{dims.dp_shard}-ep{dims.ep}"
    return name + (f"-rep{dims.dp_replicate}" if dims.hsdp_enabled else "")


def _note_schedule_change(job: PostJob, saved: str | None) -> None:
    """As `wanka train` does: one line, and a marker row in metrics.jsonl, when the LR curve
    from the resumed step on is not the one the run was following (train.steps raised, say)."""
    record = json.loads(saved) if saved else None
    change = schedule_change(record, job.cfg.train, job.start_step)
    if change is None:
        return
    if job.is_main:
        log.warning("%s", change)
    job.metrics.log_event("lr_schedule_change", job.start_step, message=change)


def _refuse_another_origin(job: PostJob, saved: dict) -> None:
    """A resume that names another post.init, teacher, reward, ... than the run started from
    (origin.py): one line, before anything in run.dir changes."""
    if (changed := origin_change(saved.get("post_origin"), job.origin)) is not None:
        raise ValueError(changed)


def _resume(job: PostJob, init: str) -> tuple[int, dict]:
    """The newest of this run's in-memory snapshot (after a fault, under the supervisor) and
    its newest checkpoint (policy + optimizer), else post.init's weights; with the records
    saved beside it (PostJob.records; empty from post.init or an older checkpoint). Nothing
    else needs restoring: prompts, the on-policy coin and sampling seeds are functions of the
    step."""
    load = job.cfg.checkpoint.load
    if job.runtime is not None and job.runtime.attempt > 1:
        load = "latest"  # a relaunch continues this job, whatever the first launch started from
    path = job.ckpt.latest_valid() if load != "none" else None
    disk_step = job.ckpt.step_of(path) if path is not None else 0
    found = job.snapshots.restore() if job.snapshots is not None and load != "none" else None
    if found is not None and found[0] >= disk_step and found[0] > 0:
        step, state = found
        extra = apply(state, job.policy, job.optimizer)
        _refuse_another_origin(job, extra)
        _say_changes(apply_hyperparameters(job.optimizer, job.cfg.train), step)  # the config's
        log.info("resumed from the in-memory snapshot of step %d", step)
        return step, extra
    if path is None:
        load_weights(job.policy, init, "post.init")
        return 0, {}
    state = job.ckpt.load(path, job.train_state())
    _refuse_another_origin(job, state)
    # as `wanka train`: the config wins
    _say_changes(apply_hyperparameters(job.optimizer, job.cfg.train), int(state["step"]))
    log.info("resumed from %s at step %d", path, state["step"])
    return int(state["step"]), state


def _say_changes(changes: list[str], step: int) -> None:
    if changes and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning("changed on resume at step %d: %s (the config's values apply from here on)",
                    step, ", ".join(changes))  # fmt: skip


def _prompts(cfg: JobConfig, dp: int, command: str
             ) -> tuple[list[TaggedPrompt], list[TaggedPrompt]]:  # fmt: skip
    p = cfg.post
    wanted = selected_domains(p.domains)
    if p.prompts == "builtin":
        unknown = sorted(set(wanted or ()) - set(DOMAINS))
        if unknown:
            raise ValueError(f"post.domains names {unknown}, but the built-in prompts have the "
                             f"domains {list(DOMAINS)}")  # fmt: skip
        # The built-in rewards judge Python: rl with them has nothing to earn on prose.
        python = command == "rl" and p.reward in PYTHON_REWARDS
        only = ("code",) if python else DOMAINS
        only = tuple(d for d in only if wanted is None or d in wanted)
        if not only:
            raise ValueError(f"post.domains={p.domains!r} leaves no built-in prompts for "
                             f"`wanka {command}`" + (f" (reward {p.reward}: code only)" if python else ""))  # fmt: skip
        # As many as the run uses (at most 2000: more cycle, each later pass shuffled anew).
        # A longer run draws more of the same sequence: see prompt_order.
        need = math.ceil(cfg.train.steps * p.prompts_per_step * dp / len(only))
        n = min(max(need, 1), BUILTIN_POOL_CAP)
        cont = 4 * p.completion_tokens  # enough reference text for off-policy rows
        seed = cfg.train.seed if p.prompt_seed < 0 else p.prompt_seed
        try:
            val = builtin_prompts("val", p.eval_prompts, p.prompt_chars, cont, seed + 1, only)
            # Documents of the two splits share text (pydoc topics quote each other): a
            # training prompt never repeats a held-out one.
            return (builtin_prompts("train", n, p.prompt_chars, cont, seed, only,
                                    exclude={x.text for x in val}), val)  # fmt: skip
        except ValueError as e:
            raise ValueError(f"post.prompts='builtin': {e} (post.eval_prompts, "
                             "post.prompt_chars, post.completion_tokens)") from None  # fmt: skip
    every = jsonl_prompts(p.prompts, wanted)
    train, held = split_held_out(every, p.eval_prompts, p.prompts)
    if (left := len(every) - len(train) - len(held)) and (not dist.is_initialized()
                                                          or dist.get_rank() == 0):  # fmt: skip
        log.warning("%s: %d line(s) repeat a held-out prompt: not trained on (%d train / %d "
                    "held-out prompts)", p.prompts, left, len(train), len(held))  # fmt: skip
    return train, held


def collected(main: Callable[[JobConfig], dict]) -> Callable[[JobConfig], dict]:
    """A post-training main whose objects are freed while Python is fully alive: the job's
    modules, FSDP state and gloo work objects sit in reference cycles, and left to interpreter
    shutdown they abort the process (SIGABRT) after a successful run (as train/trainer.run)."""

    @functools.wraps(main)
    def wrapped(cfg: JobConfig) -> dict:
        try:
            return main(cfg)
        finally:
            gc.collect()

    return wrapped


def selected_domains(spec: str) -> set[str] | None:
    """post.domains "code,prose" -> {"code", "prose"}; "" -> None (every domain)."""
    names = {x.strip() for x in spec.split(",") if x.strip()}
    return names or None
