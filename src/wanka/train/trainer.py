"""The training job: set-up, the training step, evaluation, checkpoints, summary.

Read `train_step` for what one optimizer step does; `run` for the whole job.
Every loss is a *sum* normalised by a *global* count (all micro-batches on all ranks) and
FSDP sums gradients, so N ranks compute exactly the gradient of one process on the global batch.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from wanka.config import ConfigError, JobConfig
from wanka.config.loader import save_run_config
from wanka.data.loader import Batch, PackedLoader, validation_batches
from wanka.data.prepare import NO_TARGETS, TokenDataset, ensure_builtin_dataset
from wanka.data.tokenizer import keep_run_tokenizer
from wanka.device import (
    autocast_dtype,
    dist_backend,
    keep_freed_host_memory,
    local_device,
    peak_memory_bytes,
    resolve_device_type,
)
from wanka.distributed.compression import load_reducer_states, reducer_states
from wanka.distributed.context_parallel import CPLayout, CPSharder
from wanka.distributed.cp_cost import CostModel, load_cost
from wanka.distributed.parallel_dims import ParallelDims
from wanka.distributed.parallelize import DTYPES, parallelize
from wanka.models.transformer import Transformer, mtp_labels
from wanka.resilience.worker import Preempted, Runtime
from wanka.train.checkpoint import Checkpointer, SaveSchedule
from wanka.train.metrics import MetricsWriter, format_summary
from wanka.train.optim import (
    apply_hyperparameters,
    build_optimizer,
    clip_grad_norm,
    schedule_change,
    schedule_record,
    set_lr,
)

log = logging.getLogger("wanka.train")
MAX_SKIPPED_IN_A_ROW = 3


@dataclass
class Job:
    cfg: JobConfig
    dims: ParallelDims
    device: torch.device
    model: Transformer
    optimizer: torch.optim.AdamW
    loader: PackedLoader
    val: list[Batch]
    rank: int
    run_dir: Path
    n_indexers: int
    runtime: Runtime | None = None
    cp_shard: CPSharder | None = None  # context parallel: rows of the group -> this rank's share

    def local(self, b: Batch) -> tuple[Batch, CPLayout | None]:
        """A loaded micro-batch -> what this rank computes, on the device."""
        if self.cp_shard is None:
            return b.to(self.device, non_blocking=True), None
        mine, layout = self.cp_shard(b)
        return mine.to(self.device, non_blocking=True), layout.to(self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: JobConfig, marks: list[tuple[str, float]] | None = None) -> Job:
    """The job's parts, built; `marks` gets (part, wall time when it was ready) for the
    start-up breakdown."""
    marks = [] if marks is None else marks
    device_type = resolve_device_type(cfg.run.device)
    if device_type == "cpu":  # freed blocks stay in the heap: 1.03-1.4x CPU steps (BENCHMARKS)
        keep_freed_host_memory()
    if cfg.run.ops_backend:
        from wanka.ops.registry import check_forced

        check_forced(cfg.run.ops_backend)
        os.environ["WANKA_OPS_BACKEND"] = cfg.run.ops_backend
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device_type))
    marks.append(("process group", time.time()))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device(device_type)
    run_dir = Path(cfg.run.dir)
    setup_logging(run_dir, rank)
    runtime = Runtime(cfg, rank)
    runtime.enable_stack_dumps(run_dir / "logs" / f"rank{rank}.log")
    runtime.chaos.at_start()
    dims = ParallelDims.from_config(cfg.parallel, world,
                                    int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # fmt: skip
    dims.build_meshes(device_type)
    marks.append(("meshes", time.time()))
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(cfg.train.seed)
    data_path = _dataset_path(cfg, rank)
    train_ds = TokenDataset(data_path, "train")
    check_vocab(train_ds.vocab_size, cfg.model.vocab_size)
    dp_rank = dims.mesh("dp").get_local_rank()
    rows, load_rank, load_ranks = cfg.train.micro_batch_size, dp_rank, dims.dp
    cp_shard = None
    if dims.cp_enabled:  # every rank loads the rows of all dp groups; the plan splits them
        rows, load_rank, load_ranks = rows * dims.dp, 0, 1
        cp_shard = CPSharder(dims.dp, dims.cp, dp_rank, dims.mesh("cp").get_local_rank(),
                             dims.gather_groups(), cfg.parallel.cp_layout, cfg.model.mtp_depth,
                             cfg.data.seq_len > cfg.model.index_topk, _cp_cost(cfg),
                             cfg.parallel.cp_max_span or None)  # fmt: skip
    loader = PackedLoader(train_ds, cfg.data.seq_len, rows, load_rank, load_ranks, cfg.train.seed)
    val = validation_batches(TokenDataset(data_path, "val"), cfg.data.seq_len, rows,
                             cfg.data.val_batches, load_rank, load_ranks)  # fmt: skip
    marks.append(("data", time.time()))

    # Meta device -> empty storage -> deterministic init -> shard.
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    model.init_weights(cfg.train.seed)
    n_indexers = sum(blk.attention.indexer is not None for blk in model.layers.values())
    parallelize(model, dims, param_dtype=autocast_dtype(device_type, cfg.train.mixed_precision),
                reduce_dtype=DTYPES[cfg.train.reduce_dtype],
                ac_mode=cfg.train.activation_checkpointing, compile=cfg.train.compile,
                grad_compression=cfg.comm.grad_compression, powersgd_rank=cfg.comm.powersgd_rank,
                powersgd_start=cfg.comm.powersgd_start,
                int8_block=cfg.comm.int8_block, param_gather=cfg.comm.param_gather,
                fsdp_prefetch=cfg.comm.fsdp_prefetch,
                expert_a2a=cfg.comm.expert_a2a,
                ep_overlap=cfg.comm.ep_overlap)  # fmt: skip
    try:
        optimizer = build_optimizer(model, cfg.train)
    except ValueError as e:  # torch's own checks, should a value slip past the schema's
        raise ConfigError(_optimizer_field(str(e)), str(e).splitlines()[0]) from None
    marks.append(("model", time.time()))
    return Job(cfg, dims, device, model, optimizer, loader, val, rank, run_dir, n_indexers, runtime,
               cp_shard)  # fmt: skip


def _cp_cost(cfg: JobConfig) -> CostModel:
    """The cost model the dynamic CP layout plans with: a fitted one, or the built-in estimate."""
    if not cfg.parallel.cp_cost:
        return CostModel(topk=cfg.model.index_topk)
    try:
        cost = load_cost(cfg.parallel.cp_cost, "parallel.cp_cost")
    except (OSError, ValueError) as e:
        raise ConfigError("parallel.cp_cost", str(e), "run `wanka bench cp` and point it at "
                          "its JSON, or set it to \"\"") from None  # fmt: skip
    if cost.profile and cost.topk != cfg.model.index_topk:  # its shape is that top-k's
        raise ConfigError("parallel.cp_cost", f"{cfg.parallel.cp_cost} holds a cost profile "
                          f"measured at index_topk {cost.topk}, this model's is "
                          f"{cfg.model.index_topk}", "run `wanka bench cp --index-topk "
                          f"{cfg.model.index_topk}` and point it at its JSON")  # fmt: skip
    # Seconds per token and per pair carry over; how many pairs a position has is this model's
    # (a file fitted at another index_topk counted pairs up to that k: mis-planned silently).
    return dataclasses.replace(cost, topk=cfg.model.index_topk)


def _optimizer_field(message: str) -> str:
    """The config field behind one of torch.optim's ValueErrors."""
    for needle, field in (("beta parameter at index 0", "train.beta1"),
                          ("beta parameter at index 1", "train.beta2"),
                          ("weight_decay", "train.weight_decay"), ("learning rate", "train.lr")):  # fmt: skip
        if needle in message:
            return field
    return "train"


def _dataset_path(cfg: JobConfig, rank: int) -> Path:
    if cfg.data.path != "builtin":
        return Path(cfg.data.path)
    tok = None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
    if rank == 0:  # one rank prepares; the others wait and then open it
        ensure_builtin_dataset(Path(cfg.data.cache_dir), tok)
    if dist.is_initialized():
        dist.barrier()
    return ensure_builtin_dataset(Path(cfg.data.cache_dir), tok)


def check_data(cfg: JobConfig, world_size: int) -> None:
    """Open the data as rank 0 would (preparing the built-in corpus if needed), so that a
    dataset too small for the sequence length or batch fails once, before ranks start."""
    if cfg.parallel.cp_cost:
        _cp_cost(cfg)  # a missing or foreign cost file: one line here, not one per rank
    path = _dataset_path(cfg, rank=0)
    train = TokenDataset(path, "train")
    adopt_dataset_tokenizer(cfg)
    check_vocab(train.vocab_size, cfg.model.vocab_size)
    if train.num_tokens <= train.num_docs:  # prepared before `data prepare` refused this
        raise ValueError(f"{path}: {NO_TARGETS}")
    PackedLoader(
        TokenDataset(path, "train"), cfg.data.seq_len, cfg.train.micro_batch_size, 0, world_size, 0
    )
    # One row is enough to fail an empty val split (smaller ones are read round-robin); a
    # typo'd micro_batch_size must not fill this process's memory before the ranks start.
    validation_batches(TokenDataset(path, "val"), cfg.data.seq_len, 1, 1, 0, world_size)


def adopt_dataset_tokenizer(cfg: JobConfig, warn: bool = False) -> None:
    """data.tokenizer := the tokenizer a prepared data.path was made with. The run's config
    is what `wanka generate`, export and post-training encode and decode with: left at
    "byte" for data prepared with tokenizer.json, they decoded its ids as bytes (garbage, or
    a crash) and a distillation accepted a teacher of another tokenizer. Training itself
    reads ids only: a tokenizer file that is gone or unreadable here is recorded all the
    same (`warn`: said once); a data.tokenizer that names another tokenizer is refused."""
    if cfg.data.path == "builtin":
        return
    from wanka.data.prepare import read_meta
    from wanka.data.tokenizer import load_tokenizer

    made_with = read_meta(cfg.data.path).get("tokenizer") or {}
    name, spec = made_with.get("name"), made_with.get("spec") or "byte"
    given = cfg.data.tokenizer
    if not isinstance(name, str) or (name == "byte" and given == "byte"):
        return  # nothing recorded to go by, or bytes both
    refuse = ValueError(f"data.tokenizer={given} is not the tokenizer {cfg.data.path} was "
                        f"prepared with ({spec}): drop data.tokenizer (the data's is used), or "
                        "prepare the data again with it")  # fmt: skip
    if given != "byte":  # named: it must be the data's (the same file, wherever it is)
        try:
            named = load_tokenizer(given).name  # a named file that is missing: its own line
        except ImportError:
            return  # cannot be told here; kept as given
        if named != name:
            raise refuse
        return
    try:
        why = None if load_tokenizer(spec).name == name else "has changed since"
    except (ValueError, ImportError) as e:
        why = f"cannot be loaded here ({str(e)[:120]})"
    if why and warn:
        logging.getLogger("wanka").warning(
            "data.tokenizer: %s was prepared with %s, which %s: recorded all the same (training "
            "reads ids only); generate and export need that tokenizer",
            cfg.data.path,
            spec,
            why,
        )
    cfg.data.tokenizer = spec


def dataset_tokenizer_name(cfg: JobConfig) -> str | None:
    """The name (content hash) of the tokenizer a prepared data.path was made with."""
    if cfg.data.path == "builtin":
        return None
    from wanka.data.prepare import read_meta

    name = (read_meta(cfg.data.path).get("tokenizer") or {}).get("name")
    return name if isinstance(name, str) and name.startswith("hf-") else None


def check_vocab(data_vocab: int, model_vocab: int) -> None:
    if data_vocab > model_vocab:
        fit = -(-data_vocab // 64) * 64  # a multiple of 64 keeps the embedding GEMMs aligned
        raise ValueError(f"the dataset's tokenizer has {data_vocab} tokens but model.vocab_size="
                         f"{model_vocab}: set model.vocab_size={fit} (--set model.vocab_size={fit})")  # fmt: skip


def setup_logging(run_dir: Path, rank: int) -> None:
    """One rank prints, all ranks log to RUN_DIR/logs/rank{N}.log."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("wanka")
    root.handlers.clear()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    fh.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
    root.addHandler(fh)
    if rank == 0:
        console = logging.StreamHandler()
        console.addFilter(lambda record: getattr(record, "console", True))  # file-only records
        root.addHandler(console)
    root.propagate = False


def phase_at(cfg: JobConfig, step: int) -> str:
    if cfg.train.phase == "dense_warmup" or step < cfg.train.dense_warmup_steps:
        return "dense_warmup"
    return "sparse"


def train_step(job: Job, step: int) -> dict[str, float]:
    cfg, model, rt = job.cfg, job.model, job.runtime
    t0 = time.perf_counter()
    phase = phase_at(cfg, step)
    lr = set_lr(job.optimizer, step, cfg.train)
    rt.progress.enter("data", step)
    micro = [job.local(job.loader.next_batch()) for _ in range(cfg.train.grad_accum)]
    if delay := rt.chaos.delay(step):
        time.sleep(delay)  # an injected straggler

    rt.progress.enter("sync", step)  # local data work ends here: a straggler shows in "data"
    # Global target counts first, so each micro-batch's loss is scaled to the global mean.
    counts = torch.tensor([sum(int((b.labels != -100).sum()) for b, _ in micro),
                           sum(_mtp_targets(b, lay, cfg.model.mtp_depth) for b, lay in micro)],
                          dtype=torch.float64)  # fmt: skip
    dist.all_reduce(counts)
    n_lm, n_mtp = counts.clamp(min=1).tolist()
    # Balance losses are one term per micro-batch per rank (under CP: per rank's share).
    n_micro_global = cfg.train.grad_accum * job.dims.world_size
    tokens = cfg.train.grad_accum * job.dims.dp * cfg.train.micro_batch_size * cfg.data.seq_len
    n_kl = max(tokens * job.n_indexers, 1)

    # A bad step (non-finite or spiking loss) is computed once more from the same state and
    # batch: a transient fault then leaves no trace; bad twice, the batch is skipped.
    for tries in range(2):
        sums, grad_norm = _forward_backward(
            job, micro, phase, n_lm, n_mtp, n_kl, n_micro_global, step
        )
        lm = float(sums[0]) / n_lm  # NaN if any micro-batch loss was non-finite
        bad = rt.guard.check(lm, float(grad_norm)) if cfg.resilience.nan_guard else None
        for reducer in getattr(model, "grad_reducers", ()):  # error feedback of kept steps only
            if bad:
                reducer.rollback()
            else:
                reducer.commit()
        if bad is None:
            break
        job.optimizer.zero_grad(set_to_none=True)
        for m in model.moe_layers():
            m.load.zero_()
        log.warning("step %d: %s; %s", step + 1, bad,
                    "retrying it" if tries == 0 else "skipping this batch")  # fmt: skip
        now = time.time()
        rt.event("fault", now, now, cause="nan", rank=None, node=rt.node, detail=bad, step=step,
                 injected=bool(sums[5] > 0))  # fmt: skip
    skipped = bad is not None
    rt.skipped_in_a_row = rt.skipped_in_a_row + 1 if skipped else 0
    if rt.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:  # the state, not one batch, is bad
        raise RuntimeError(f"{MAX_SKIPPED_IN_A_ROW} batches in a row were bad ({bad}); stopping "
                           "so the supervisor restores the last good snapshot")  # fmt: skip
    rt.settle_snapshot(step - 1)  # the last step's copy, which ran under this one (overlap)
    rt.progress.enter("optimizer", step)
    if not skipped:
        job.optimizer.step()
        rt.guard.accept(lm)  # the spike guard follows the LM loss through both phases
    job.optimizer.zero_grad(set_to_none=True)
    imbalance = _update_expert_bias(
        model, cfg.model.bias_update_rate if phase == "sparse" and not skipped else 0.0
    )
    dt = time.perf_counter() - t0
    lm, mtp, kl_sum, bal, seq_bal, _ = sums.tolist()
    return {
        "loss": kl_sum / n_kl if phase == "dense_warmup" else lm / n_lm,  # what is trained
        "lm_loss": lm / n_lm, "mtp_loss": mtp / n_mtp,
        "indexer_kl": kl_sum / n_kl, "moe_balance": bal / n_micro_global,
        "moe_seq_balance": seq_bal / n_micro_global,
        "moe_max_load": imbalance, "grad_norm": float(grad_norm), "lr": lr,
        "step_time": dt, "tokens_per_s": tokens / dt, "phase_sparse": float(phase == "sparse"),
        "retried": float(tries > 0), "skipped": float(skipped),
    }  # fmt: skip


def _forward_backward(job: Job, micro: list[tuple[Batch, CPLayout | None]], phase: str, n_lm: float, n_mtp: float,
                      n_kl: float, n_micro_global: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of the global-mean loss over all micro-batches; returns the global loss sums
    (all-reduced, so every rank can judge the step alike) and the clipped global grad norm."""
    cfg, model, rt = job.cfg, job.model, job.runtime
    sums = torch.zeros(6, dtype=torch.float64)  # lm, mtp, kl, balance, seq balance, injected
    for i, (b, layout) in enumerate(micro):
        # Accumulate unsharded grads locally; reduce-scatter once, after the last micro-batch.
        model.set_requires_gradient_sync(i == len(micro) - 1)
        rt.progress.enter("forward", step)
        # bf16 compute comes from FSDP's mixed-precision policy (set in parallelize), not autocast.
        parts = model(b.tokens, b.positions, b.doc_ids, b.labels, phase=phase, layout=layout)
        kl = parts.kl_sum / n_kl
        if phase == "dense_warmup":
            loss = kl  # only the indexer learns
        else:
            loss = (parts.lm_sum / n_lm + cfg.model.mtp_loss_weight * parts.mtp_sum / n_mtp + kl
                    + cfg.model.balance_loss_weight * parts.balance / n_micro_global
                    + cfg.model.seq_balance_loss_weight * parts.seq_balance / n_micro_global)  # fmt: skip
        if i == 0 and rt.chaos.nan_now(step):
            loss = loss * float("nan")  # an injected numeric fault (e.g. a flipped bit)
            sums[5] += 1  # every rank learns it was injected (the report marks it so)
        rt.progress.enter("backward", step)
        loss.backward()
        sums[:5] += torch.stack([parts.lm_sum.detach(), parts.mtp_sum.detach(), parts.kl_sum.detach(),
                                 parts.balance.detach(), parts.seq_balance.detach()]).double().cpu()  # fmt: skip
        if not torch.isfinite(loss.detach()):
            sums[0] = float("nan")
    rt.progress.enter("optimizer", step)
    if phase == "dense_warmup":  # only the indexers train: under compressed HSDP the others
        for name, p in model.named_parameters():  # got zeros (whole layouts), which AdamW
            if ".indexer." not in name:  # would step (weight decay, state, bias correction)
                p.grad = None
    # Under HSDP a replica holds every gradient element once: sum squares over one replica.
    shard = job.dims.mesh("shard").get_group() if job.dims.hsdp_enabled else None
    grad_norm = clip_grad_norm(list(model.parameters()), cfg.train.grad_clip, group=shard)
    dist.all_reduce(sums)
    return sums, grad_norm


def _mtp_targets(b: Batch, layout: CPLayout | None, depth: int) -> int:
    if layout is not None:  # the labels MTP looks ahead to may sit on another rank
        return sum(int((t != -100).sum()) for t in layout.mtp_labels)
    return sum(int((mtp_labels(b.labels, b.doc_ids, d) != -100).sum()) for d in range(1, depth + 1))


@torch.no_grad()
def _update_expert_bias(model: Transformer, rate: float) -> float:
    """All-reduce per-expert loads, nudge the selection bias; return max load / mean load."""
    moes = model.moe_layers()
    if not moes:
        return 1.0
    loads = torch.stack([m.load for m in moes])
    dist.all_reduce(loads)
    for m, load in zip(moes, loads):
        m.update_bias(load, rate)
    return float((loads.max(1).values / loads.mean(1).clamp(min=1e-9)).mean())


@torch.no_grad()
def evaluate(job: Job, step: int) -> float:
    """Held-out LM loss in nats per token (per byte with the byte tokenizer)."""
    job.model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    for rows in job.val:
        b, layout = job.local(rows)
        parts = job.model(b.tokens, b.positions, b.doc_ids, b.labels, phase=phase_at(job.cfg, step),
                          layout=layout)  # fmt: skip
        sums += torch.stack([parts.lm_sum.double().cpu(), parts.lm_count.double().cpu()])
    for m in job.model.moe_layers():
        m.load.zero_()  # eval routing must not count toward balancing
    job.model.train()
    dist.all_reduce(sums)
    return float(sums[0] / sums[1].clamp(min=1))


def _layout_name(dims: ParallelDims, grad_compression: str) -> str:
    """How parameters are sharded (snapshots only restore onto the same layout)."""
    name = f"dp{dims.dp_shard}-ep{dims.ep}-cp{dims.cp}"
    if dims.hsdp_enabled:  # compression shards over a replica's ranks only
        name += f"-rep{dims.dp_replicate}" + ("-hook" if grad_compression != "none" else "")
    return name


def run(cfg: JobConfig) -> dict:
    """The whole job. Returns the summary (also written to RUN_DIR/summary.json)."""
    try:
        return _run(cfg)
    finally:
        # The job's objects sit in reference cycles (modules, FSDP state, hooks); some hold gloo
        # work objects with tensors. Left to the interpreter's shutdown, destroying them takes
        # the GIL from a torn-down interpreter: SIGABRT ("terminate called without an active
        # exception") after a successful run. Free them while Python is fully alive.
        gc.collect()


def _run(cfg: JobConfig) -> dict:
    t_start = time.perf_counter()
    t_entry = time.time()
    marks: list[tuple[str, float]] = []
    job = setup(cfg, marks)
    rt = job.runtime
    ckpt = Checkpointer(job.run_dir / "checkpoints", job.model, job.optimizer, cfg.checkpoint.keep,
                        cfg.checkpoint.async_save, job.is_main)  # fmt: skip
    from wanka.resilience.snapshot import layout_signature

    snapshots = rt.snapshot_store(job.dims.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                  layout_signature(job.model, job.dims.world_size,
                                                   _train_state(job)["model_config"],
                                                   _layout_name(job.dims, cfg.comm.grad_compression)),
                                  overlap=cfg.resilience.snapshot_overlap)  # fmt: skip
    marks.append(("checkpointer + snapshots", time.time()))
    with rt.span("restore") as info:
        rt.progress.enter("restore")
        start = _resume(job, ckpt, snapshots, info)
    marks.append(("restore", time.time()))
    if start > cfg.train.steps:
        raise ValueError(f"{job.run_dir} is already at step {start} but train.steps={cfg.train.steps}: "
                         f"raise train.steps above {start} to train on, or use a new run.dir")  # fmt: skip
    if 0 < start == cfg.train.steps and _finished(job, ckpt, start):
        return _already_finished(job, snapshots)
    if job.is_main:  # only now: a refused resume must leave the run's config as it was
        adopt_dataset_tokenizer(cfg, warn=True)
        save_run_config(job.run_dir, cfg)
        keep_run_tokenizer(cfg.data.tokenizer, job.run_dir, dataset_tokenizer_name(cfg))
    t_launch = rt.launch_time or t_entry
    parts = _startup_parts(t_launch, t_entry, marks)
    for _, var in LAUNCH_MARKS:  # this launch's: not for a process a rank may start
        os.environ.pop(var, None)
    rt.event("startup", t_launch, time.time(), parts=parts)
    log.info("start-up %.2f s: %s", sum(parts.values()),
             ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), extra={"console": False})  # fmt: skip
    metrics = MetricsWriter(job.run_dir, job.is_main, cfg.train.steps, cfg.run.tensorboard)
    # Resumed at the last step, unfinished: its final eval (written after the last checkpoint)
    # is done again, so a row of it from the attempt that died is dropped.
    metrics.truncate_after(start, drop_evals_at=start if start == cfg.train.steps else None)
    if start > 0:
        metrics.log_event("resume", start, source=info.get("source"))
    if change := info.get("lr_schedule_change"):  # one line, once, plus a marker row
        if job.is_main:
            log.warning("%s", change)
        metrics.log_event("lr_schedule_change", start, message=change)
    log.info("run dir %s | world %d (dp %d x %d x cp %d, ep %d) | start step %d", job.run_dir,
             job.dims.world_size, job.dims.dp_replicate, job.dims.dp_shard, job.dims.cp,
             job.dims.ep, start)  # fmt: skip

    tokens_per_s, step_times, val_loss, train_loss = [], [], None, None
    mtbf = float(os.environ.get("WANKA_MTBF_S") or cfg.checkpoint.mtbf_s)
    schedule = SaveSchedule(cfg.checkpoint.every, mtbf, start)
    every = cfg.checkpoint.every
    if (cfg.checkpoint.enable and every and 0 < start < cfg.train.steps and start % every == 0
            and not ckpt.holds(start)):  # fmt: skip
        # Resumed from memory at a step whose checkpoint a fault cut short: no later pass of
        # the loop writes it, and a job that lost its memory too would fall back further.
        with rt.span("checkpoint", step=start - 1), ckpt.report(rt.event, rt.node):
            ckpt.save(start, _train_state(job))
    for step in range(start, cfg.train.steps):
        # The step span is the whole iteration: the stop agreement (which also absorbs the
        # ranks' skew), the step, its metrics and its snapshot stall, so time between spans is
        # really outside training. The snapshot span nests inside and is charged as a stall.
        with rt.span("step", step=step) as span:
            stop = rt.stop_before_step(step, span)  # everyone stops here, together
            if not stop:
                m = train_step(job, step)
                _log_step(job, metrics, m, step, start)
                if snapshots is not None and (step + 1) % cfg.resilience.snapshot_every == 0:
                    with rt.span("snapshot", step=step), rt.phase("snapshot", step):
                        snapshots.save(step + 1, _snapshot_state(job))
        if stop:
            _last_gasp(job, ckpt, snapshots, step)
        tokens_per_s.append(m["tokens_per_s"])
        step_times.append(m["step_time"])
        train_loss = m["loss"]
        if (step + 1) % cfg.train.eval_every == 0 and step + 1 != cfg.train.steps:
            with rt.span("eval", step=step), rt.phase("eval", step):
                val_loss = evaluate(job, step)
            metrics.log_eval(step + 1, {"val_loss": val_loss})
        if cfg.checkpoint.enable and (schedule.due(step + 1) or step + 1 == cfg.train.steps):
            t_save = time.perf_counter()
            # Only the last save must succeed. A periodic one that cannot be written (disk full)
            # is logged, recorded as a fault and skipped: the run goes on, the next one retries.
            with (rt.span("checkpoint", step=step) as ck_span, rt.phase("checkpoint", step),
                  ckpt.report(rt.event, rt.node, ck_span)):  # fmt: skip
                last = step + 1 == cfg.train.steps
                saved = ckpt.save(step + 1, _train_state(job), must_succeed=last)
            if saved is None:
                schedule.failed(step + 1)
            else:
                schedule.saved(step + 1, time.perf_counter() - t_save, _median(step_times[-20:]))
    rt.progress.enter("checkpoint")
    with ckpt.report(rt.event, rt.node):
        ckpt.wait()  # the last save, when async: raises if it could not be written
        if cfg.checkpoint.enable and 0 < start == cfg.train.steps and not ckpt.holds(start):
            # Resumed at the very end from a snapshot (the last save had failed): write it now.
            with rt.span("checkpoint", step=start - 1):
                ckpt.save(start, _train_state(job))
                ckpt.wait()
    if snapshots is not None:
        snapshots.close(discard=True)  # finished: nothing left to recover from memory
    with rt.span("eval", step=cfg.train.steps), rt.phase("eval"):
        val_loss = evaluate(job, cfg.train.steps)
    metrics.log_eval(cfg.train.steps, {"val_loss": val_loss})
    metrics.close()
    summary = _finish(job, ckpt, t_start, val_loss, train_loss, tokens_per_s, step_times, start)
    rt.progress.close()
    # Leave together: a rank that exits (and tears its process group down) while rank 0 still
    # writes the report would make the launcher kill rank 0 mid-write.
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _finished(job: Job, ckpt: Checkpointer, start: int) -> bool:
    """The run got to its end and wrote its summary (else, e.g. killed in the final eval, it
    does the end again: eval, summary). Every rank reads rank 0's answer."""
    ok = [not job.cfg.checkpoint.enable or ckpt.holds(start)]
    if ok[0] and job.is_main:
        try:
            ok[0] = json.loads((job.run_dir / "summary.json").read_text())["steps"] == start
        except (OSError, ValueError, KeyError, TypeError):
            ok[0] = False
    dist.broadcast_object_list(ok, src=0)
    return bool(ok[0])


def _already_finished(job: Job, snapshots) -> dict:
    """A rerun of a finished run: nothing to train. Its summary and metrics stay as they are
    (a rerun wrote a summary of nulls over them and a second final eval row)."""
    steps = job.cfg.train.steps
    if snapshots is not None:
        snapshots.close(discard=True)
    summary: dict = {}
    if job.is_main:
        log.warning("%s already finished its %d steps: nothing to train (raise train.steps to "
                    "train on, or use a new run.dir)", job.run_dir, steps)  # fmt: skip
        summary = json.loads((job.run_dir / "summary.json").read_text())  # (read just now)
    job.runtime.progress.close()
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _log_step(job: Job, metrics: MetricsWriter, m: dict, step: int, start: int) -> None:
    log_every, steps = job.cfg.train.log_every, job.cfg.train.steps
    if step == start or (step + 1) % log_every == 0 or step + 1 == steps:
        metrics.log_train(step + 1, m)


def _last_gasp(job: Job, ckpt: Checkpointer, snapshots, step: int) -> None:
    """Stop on request: a persistent checkpoint of the state after `step` steps, then leave."""
    rt = job.runtime
    with (rt.span("last_gasp", step=step), rt.phase("checkpoint", step),
          ckpt.report(rt.event, rt.node)):  # fmt: skip
        ckpt.wait()  # a periodic save still being written: its failure is only reported
        if snapshots is not None:
            snapshots.wait()
        ckpt.async_save = False
        ckpt.save(step, _train_state(job))  # must succeed: else exit 2 with the reason
    log.info(
        "stopped on request at step %d; checkpoint %s written",
        step,
        ckpt.latest(),
        extra={"console": False},
    )  # the launcher's one line says it on the console
    dist.barrier()
    dist.destroy_process_group()
    raise Preempted(f"stopped on request at step {step}")


# Times the launch path records on its way to the trainer (a node launcher when it got its
# orders; the rank's process when it began), in the order they happen.
LAUNCH_MARKS = (("orders", "WANKA_ORDERS_TIME"), ("rendezvous + ranks", "WANKA_RANK_START_TIME"))


def _startup_parts(t_launch: float, t_entry: float, marks: list[tuple[str, float]],
                   env: dict | None = None) -> dict:  # fmt: skip
    """Seconds per start-up part: from the launch (the supervisor's attempt start) to this
    process's training code, split where the launch path left marks (LAUNCH_MARKS: the node
    launcher's orders, the rendezvous and the ranks' start), the rest "to the trainer"; then
    each part until its mark. Marks from another host's clock are clamped to the interval."""
    env = os.environ if env is None else env
    parts, last = {}, t_launch
    for name, var in LAUNCH_MARKS:
        try:
            t = float(env[var])
        except (KeyError, ValueError):
            continue  # not launched that way (plain torchrun; no node launcher: no orders)
        t = min(max(t, last), t_entry)
        parts[name], last = round(t - last, 4), t
    parts["to the trainer"], last = max(t_entry - last, 0.0), t_entry
    for name, t in marks:
        parts[name], last = round(t - last, 4), t
    return parts


def _snapshot_state(job: Job) -> dict:
    from wanka.resilience.snapshot import capture

    extra = {"loader": job.loader.state_dict(), "guard": job.runtime.guard.state_dict(),
             "comm": reducer_states(job.model),
             "lr_schedule": json.dumps(schedule_record(job.cfg.train), sort_keys=True)}  # fmt: skip
    return capture(job.model, job.optimizer, extra)


def _train_state(job: Job) -> dict:
    """What besides model and optimizer a checkpoint holds; the model config guards resumes."""
    model_cfg = json.dumps(dataclasses.asdict(job.cfg.model), sort_keys=True)
    guard = json.dumps(job.runtime.guard.state_dict())
    # The LR schedule in force: a resume compares it with its own (see _note_schedule_change).
    schedule = json.dumps(schedule_record(job.cfg.train), sort_keys=True)
    return {"loader": job.loader.state_dict(), "model_config": model_cfg, "guard": guard,
            "lr_schedule": schedule}  # fmt: skip


def _note_schedule_change(job: Job, saved: str | None, step: int, info: dict) -> None:
    """Record in `info` (hence the restore event) a one-line note when the LR curve from `step`
    on is not the one the checkpoint was following; checkpoints from before the record: none."""
    change = schedule_change(json.loads(saved) if saved else None, job.cfg.train, step)
    if change is not None:
        info["lr_schedule_change"] = change


def _say_changes(job: Job, changes: list[str], step: int) -> None:
    """One line for optimizer settings the config changed on resume (the lr: its own note)."""
    if changes and job.is_main:
        log.warning("changed on resume at step %d: %s (the config's values apply from here on)",
                    step, ", ".join(changes))  # fmt: skip


def _resume(job: Job, ckpt: Checkpointer, snapshots, info: dict) -> int:
    """Newest of: an in-memory snapshot (same layout only), the newest valid DCP checkpoint."""
    load = job.cfg.checkpoint.load
    if job.runtime.attempt > 1:
        load = "latest"  # a relaunch continues this job, whatever the first launch started from
    if load == "none" and ckpt.latest() is not None:
        raise ValueError(f"{job.run_dir} already holds checkpoints ({ckpt.latest().name}) and "
                         "checkpoint.load='none': use a new run.dir, or resume with 'latest'")  # fmt: skip
    path = None if load == "none" else (ckpt.latest_valid() if load == "latest" else Path(load))
    for problem in ckpt.skipped:  # damaged checkpoints met on the way (rank 0 knows them)
        now = time.time()
        job.runtime.event("fault", now, now, cause="checkpoint_corrupt", rank=None,
                          node=job.runtime.node, detail=problem)  # fmt: skip
    disk_step = ckpt.step_of(path) if path is not None else 0
    lost = getattr(snapshots, "other_layout_step", None)
    if lost is not None and lost > disk_step and load == "latest" and ckpt.is_main:
        log.warning("the in-memory snapshot of step %d was taken with another parallel layout "
                    "(world size, degrees or model) and cannot restore onto this one: it was "
                    "dropped, and the run resumes from step %d (a layout change keeps what the "
                    "newest checkpoint holds)", lost, disk_step)  # fmt: skip
    if snapshots is not None and load == "latest":
        from wanka.resilience.snapshot import apply

        found = snapshots.restore()
        if found is not None and found[0] >= disk_step:
            step, state = found
            extra = apply(state, job.model, job.optimizer)
            job.loader.load_state_dict(extra["loader"])
            job.runtime.guard.load_state_dict(extra["guard"])
            load_reducer_states(job.model, extra.get("comm", []))  # same layout: always fits
            _say_changes(job, apply_hyperparameters(job.optimizer, job.cfg.train), step)
            info.update(source="memory", step=step)
            # A job stopped and started again with another schedule resumes from memory too.
            _note_schedule_change(job, extra.get("lr_schedule"), step, info)
            ckpt.say_none_usable(f"resuming from the in-memory snapshot of step {step}")
            log.info("resumed from the in-memory snapshot of step %d", step)
            return step
    if path is None and job.cfg.checkpoint.init_weights:
        ckpt.say_none_usable("starting from checkpoint.init_weights")  # if its own are damaged
        return _init_weights(job, ckpt, info)
    if path is None:
        ckpt.say_none_usable()  # "no usable checkpoint in ...; starting from step 0" if damaged
        info.update(source="none", step=0)
        return 0
    state = ckpt.load(path, _train_state(job))
    if load != "latest":  # only once the given checkpoint loaded: a refused one moves nothing
        _went_back(ckpt, snapshots, path, load)
    if "loader" in state:  # else a model-only checkpoint (`wanka import`): data from the start
        job.loader.load_state_dict(state["loader"])
    if "guard" in state:
        job.runtime.guard.load_state_dict(json.loads(state["guard"]))
    _say_changes(job, apply_hyperparameters(job.optimizer, job.cfg.train), int(state["step"]))
    info.update(source="disk", step=int(state["step"]))
    _note_schedule_change(job, state.get("lr_schedule"), int(state["step"]), info)
    log.info("resumed from %s at step %d", path, state["step"])
    return int(state["step"])


def _went_back(ckpt: Checkpointer, snapshots, path: Path, load: str) -> None:
    """checkpoint.load started the run from `path`: a restart continues from here, not from
    what memory or the run's newer checkpoints held before."""
    if snapshots is not None:
        snapshots.forget()
    if ckpt.is_main:
        from wanka.train.checkpoint import supersede

        if (aside := supersede(ckpt.root, path)) is not None:
            log.warning("checkpoint.load=%s goes back from this run's newer checkpoints: "
                        "moved them to %s (kept), so that restarts and pruning follow the "
                        "run from here", load, aside)  # fmt: skip


def _init_weights(job: Job, ckpt: Checkpointer, info: dict) -> int:
    """A new run from another run's weights (checkpoint.init_weights): the model only, checked
    against this run's [model] config; optimizer, step and data start fresh."""
    given = Path(job.cfg.checkpoint.init_weights)
    path = given
    if (given / "checkpoints").is_dir():  # a run directory: its newest sound checkpoint
        path = ckpt.newest_sound(given / "checkpoints")  # read only: damaged ones not flagged
        if path is None:
            raise ValueError(f"checkpoint.init_weights={str(given)!r} holds no complete, "
                             "undamaged checkpoint: point it at a trained run or one of its "
                             "checkpoints")  # fmt: skip
    ckpt.load(path, {"model_config": _train_state(job)["model_config"]}, weights_only=True,
              field="checkpoint.init_weights")  # fmt: skip
    info.update(source="init_weights", step=0)
    log.info("starting from the weights of %s (optimizer, step and data fresh)", path)
    return 0


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: device allocator peak, or process max RSS on CPU; max over ranks."""
    peak = peak_memory_bytes(device)
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    t = torch.tensor([peak / 2**20], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over every rank's local model and optimizer tensors, in rank order: two runs
    with equal digests ended in bitwise-identical states (the fault drills compare them)."""
    import hashlib

    from wanka.resilience.snapshot import capture

    state = capture(model, optimizer, {})
    h = hashlib.sha256()
    for part in ("model", "optim"):
        flat = state[part] if part == "model" else state[part]["state"]
        for key in sorted(flat, key=str):
            val = flat[key]
            for t in val.values() if isinstance(val, dict) else [val]:
                if isinstance(t, torch.Tensor):
                    h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def _finish(job, ckpt, t_start, val_loss, train_loss, tokens_per_s, step_times, start) -> dict:
    summary = {
        "val_loss": val_loss, "train_loss": train_loss,
        "tokens_per_s": _median(tokens_per_s),
        "wall_time_s": time.perf_counter() - t_start, "steps": job.cfg.train.steps,
        "resumed_from_step": start, "world_size": job.dims.world_size,
        "peak_memory_mb": _peak_memory_mb(job.device),
        "step_time_s": _median(step_times),
        "state_digest": state_digest(job.model, job.optimizer),
        "checkpoint_dir": str(ckpt.latest()) if ckpt.latest() else None,
        "metrics_file": str(job.run_dir / "metrics.jsonl"),
    }  # fmt: skip
    if job.is_main:
        from wanka.report import LOSS_CURVE_LATER, plot_loss_curves

        if os.environ.get(LOSS_CURVE_LATER) == "1":  # the supervisor draws it after the job
            summary["loss_curve"] = str(job.run_dir / "loss_curve.png")
        else:
            summary["loss_curve"] = str(plot_loss_curves(job.run_dir))
        (job.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_summary(summary), flush=True)
    return summary
