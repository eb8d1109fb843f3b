"""Pre-flight: check a job's configuration and its machines before (re)launching it.

Static checks need no processes: parallel degrees, sequence lengths, the per-device memory
estimate against capacity, batch arithmetic, data and tokenizer, room for checkpoints and
in-memory snapshots. Live checks start real ranks (torch elastic, the job's backend) and measure
backend start-up, every link (timed all-reduce on disjoint rank pairs, intra- and inter-node
separately), a short matmul burn-in compared across ranks, and free memory. The supervisor runs
`preflight` before every (re)launch; `wanka check` prints the same report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wanka.device import resolve_device_type

GIB = 1024**3
# Burn-in rate below this fraction of the median rank = a slow device (the synchronous job runs
# at the pace of its slowest rank, so one such device costs the whole job that fraction).
SLOW_DEVICE_RATIO = 0.6
# A link this many times slower than the median link of its class fails; within it, it warns
# from WARN_LINK_RATIO on. Classes are not compared with each other: inter-node links are
# expected to be slower than intra-node ones (NVLink vs network, loopback vs shaped veth).
SLOW_LINK_FACTOR = 2.0
WARN_LINK_RATIO = 0.75
# Fault injection for tests and drills: this global rank's burn-in runs at SLOW_FACTOR speed.
SLOW_RANK_ENV, SLOW_FACTOR_ENV = "WANKA_PREFLIGHT_SLOW_RANK", "WANKA_PREFLIGHT_SLOW_FACTOR"


@dataclass
class CheckResult:
    name: str
    ok: bool
    message: str  # one line; when not ok it says what to fix
    seconds: float = 0.0
    warn: bool = False  # ok but suspicious


@dataclass
class PreflightReport:
    results: list[CheckResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def format(self) -> str:
        width = max((len(r.name) for r in self.results), default=0)
        lines = [f"{'FAIL' if not r.ok else 'WARN' if r.warn else 'PASS'}  {r.name:{width}s}  "
                 f"{r.message}  ({r.seconds:.2f}s)" for r in self.results]  # fmt: skip
        failed = sum(not r.ok for r in self.results)
        warned = sum(r.ok and r.warn for r in self.results)
        verdict = "FAILED: fix the FAIL lines before launching" if failed else "ready to launch"
        lines.append(f"pre-flight: {len(self.results)} checks, {failed} failed, {warned} "
                     f"warnings in {self.seconds:.1f}s: {verdict}")  # fmt: skip
        return "\n".join(lines)


class _Checks:
    """Collects results; each check is timed and its exception becomes a FAIL line instead of
    hiding the checks after it."""

    def __init__(self) -> None:
        self.results: list[CheckResult] = []

    def run(self, name: str, fn, *args) -> None:
        from wanka.distributed.parallel_dims import ParallelError

        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except ParallelError as e:
            # Batch, memory and snapshot sizes depend on the degrees: report the cause once.
            first = not any(r.name == "parallel.degrees" and not r.ok for r in self.results)
            out = CheckResult(name, not first, str(e) if first else "not checked: fix "
                              "parallel.degrees first", warn=not first)  # fmt: skip
        except (ValueError, OSError) as e:  # wanka's one-line user errors (ConfigError too)
            out = CheckResult(name, False, str(e))
        except Exception as e:  # noqa: BLE001  (the report must list every check)
            out = CheckResult(name, False, f"{type(e).__name__}: {e}")
        for r in out if isinstance(out, list) else [out]:
            r.seconds = time.perf_counter() - t0
            self.results.append(r)


# ---------------------------------------------------------------- static checks


def static_checks(cfg, world_size: int, nnodes: int = 1,
                  capacity_bytes: int | None = None) -> list[CheckResult]:  # fmt: skip
    """Checks that need no processes. `capacity_bytes` overrides the per-rank memory capacity
    (default: the device's memory, or on CPU the available RAM shared by the local ranks)."""
    c = _Checks()
    c.run("config", _check_config, cfg)
    c.run("parallel.degrees", _check_degrees, cfg, world_size, nnodes)
    c.run("sequence", _check_sequence, cfg)
    c.run("batch", _check_batch, cfg, world_size)
    c.run("memory", _check_memory, cfg, world_size, nnodes, capacity_bytes)
    c.run("data", _check_data, cfg, world_size)
    c.run("checkpoint", _check_checkpoint, cfg)
    c.run("snapshot", _check_snapshot, cfg, world_size, nnodes)
    return c.results


def _check_config(cfg) -> CheckResult:
    from wanka.config.loader import validate

    validate(cfg)  # a ConfigError names the field and the fix; _Checks turns it into FAIL
    if cfg.run.ops_backend:
        from wanka.ops.registry import check_forced

        check_forced(cfg.run.ops_backend)
    return CheckResult("config", True, "fields valid")


def _dims(cfg, world_size: int):
    from wanka.distributed.parallel_dims import ParallelDims

    return ParallelDims.from_config(cfg.parallel, world_size)


def _check_degrees(cfg, world_size: int, nnodes: int) -> CheckResult:
    if nnodes <= 0 or world_size % nnodes:
        return CheckResult("parallel.degrees", False, f"{world_size} ranks do not split evenly "
                           f"over {nnodes} nodes: launch the same --nproc on every node")  # fmt: skip
    d = _dims(cfg, world_size)  # ep vs n_experts is the config check's (validate)
    return CheckResult("parallel.degrees", True, f"dp_replicate={d.dp_replicate} "
                       f"dp_shard={d.dp_shard} ep={d.ep} "
                       f"(experts {cfg.model.n_experts // d.ep}/rank) over {world_size} ranks "
                       f"= {nnodes} node(s) x {world_size // nnodes}")  # fmt: skip


def _check_sequence(cfg) -> CheckResult:
    m, s = cfg.model, cfg.data.seq_len
    if s > m.max_seq_len:
        return CheckResult("sequence", False, f"data.seq_len={s} > model.max_seq_len="
                           f"{m.max_seq_len}: lower data.seq_len or raise model.max_seq_len")  # fmt: skip
    if m.index_topk >= s:  # it trains; but the sparse path never runs, so say so
        return CheckResult("sequence", True, f"model.index_topk={m.index_topk} >= data.seq_len="
                           f"{s}: every key is within the top-k, so attention is dense at this "
                           f"length (set model.index_topk below {s} to train the sparse path)",
                           warn=True)  # fmt: skip
    return CheckResult("sequence", True, f"seq_len {s} <= max_seq_len {m.max_seq_len}; each "
                       f"query attends to top-{m.index_topk} ({m.index_topk / s:.0%})")  # fmt: skip


def _check_batch(cfg, world_size: int) -> CheckResult:
    t = cfg.train
    dp = _dims(cfg, world_size).dp
    seqs = t.micro_batch_size * t.grad_accum * dp
    tokens = seqs * cfg.data.seq_len
    msg = (f"global batch {seqs} seqs = micro {t.micro_batch_size} x accum {t.grad_accum} x dp "
           f"{dp}; {tokens:,} tokens/step, {tokens * t.steps:,} in {t.steps} steps")  # fmt: skip
    if t.warmup_steps >= t.steps:
        return CheckResult("batch", True, msg + f"; train.warmup_steps={t.warmup_steps} >= "
                           "steps: lr never peaks, lower warmup_steps", warn=True)  # fmt: skip
    return CheckResult("batch", True, msg)


def param_counts(cfg):
    from wanka.models.stats import count_params

    return count_params(cfg.model)


def checkpoint_bytes(cfg) -> int:
    """One checkpoint on disk: fp32 params + 2 Adam moments (DCP, unsharded total), plus what
    the bare 12 bytes per parameter missed (a review filled a disk the pre-flight had passed:
    11.2 MiB written against 10.8 estimated): DCP's per-tensor records and .metadata, the
    optimizer's step counters, buffers, RNG and loader state. 2% + 4 MiB covers them."""
    params = param_counts(cfg).total * 12
    return params + params // 50 + (4 << 20)


def memory_need_bytes(cfg, world_size: int) -> int:
    """Per-rank peak for this job (models/stats.py `job_memory`): its layout (dp_shard, ep),
    data.seq_len, train.micro_batch_size, compute dtype (train.mixed_precision on this device),
    train.reduce_dtype, train.activation_checkpointing and training phases; the larger of the
    training step and the model's initialisation."""
    return int(_job_memory(cfg, world_size).peak)


def _job_memory(cfg, world_size: int):
    from wanka.models.stats import job_memory

    _dims(cfg, world_size)  # invalid degrees: reported once, by parallel.degrees
    return job_memory(cfg, world_size, resolve_device_type(cfg.run.device))


def _mem_available() -> int:
    """MemAvailable of /proc/meminfo: what can be allocated without swapping or OOM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory(device_type: str, local_ranks: int, index: int = 0) -> tuple[int, int]:
    """(free, total) bytes one rank can use. CPU: the node's available RAM split among its
    local ranks. Accelerators: device `index` as torch reports it (only reached when
    resolve_device_type found the device, so torch.cuda/torch.npu are usable)."""
    if device_type == "cpu":
        share = _mem_available() // max(local_ranks, 1)
        return share, share
    mod = getattr(torch, device_type)
    free, total = mod.mem_get_info(index)
    return int(free), int(total)


def _check_memory(cfg, world_size: int, nnodes: int, capacity: int | None) -> CheckResult:
    est = _job_memory(cfg, world_size)
    need = int(est.peak)
    device_type = resolve_device_type(cfg.run.device)
    where = "given capacity"
    if capacity is None:
        capacity = device_memory(device_type, world_size // max(nnodes, 1))[1]
        where = "RAM available per local rank" if device_type == "cpu" else f"{device_type} memory"
    at = "initialisation" if est.init_peak > est.train_peak else est.peak_at
    msg = (f"estimate {need / GIB:.2f} GiB/rank (peak at {at}; {est.settings.compute_dtype} "
           f"compute, activation checkpointing {est.settings.activation_checkpointing}) vs "
           f"{capacity / GIB:.2f} GiB {where}")  # fmt: skip
    local = world_size // max(nnodes, 1)
    if need > capacity and device_type == "cpu" and where != "given capacity" and local > 1:
        return CheckResult("memory", False, msg + f" ({local} ranks share this machine's RAM): "
                           "start fewer ranks (--nproc), or lower train.micro_batch_size or "
                           "data.seq_len")  # fmt: skip
    if need > capacity:
        return CheckResult("memory", False, msg + ": lower train.micro_batch_size or "
                           "data.seq_len, set train.activation_checkpointing, or add ranks "
                           "(parallel.dp_shard) / raise parallel.ep")  # fmt: skip
    return CheckResult("memory", True, msg, warn=need > 0.9 * capacity)


def _check_data(cfg, world_size: int) -> list[CheckResult]:
    from wanka.data.prepare import read_meta
    from wanka.data.tokenizer import load_tokenizer
    from wanka.train.trainer import _dataset_path, check_data

    # The same opening the ranks do (prepares the built-in corpus if needed): a missing, corrupt
    # or too-small dataset fails here with the loader's own one-line fix.
    check_data(cfg, world_size)
    path = _dataset_path(cfg, rank=0)
    meta = read_meta(path)
    vocab, tok_name = meta["vocab_size"], meta["tokenizer"]["name"]
    out = []
    if vocab > cfg.model.vocab_size:
        out.append(CheckResult("data", False, f"{path} has vocab {vocab} > model.vocab_size="
                               f"{cfg.model.vocab_size}: raise model.vocab_size to >= {vocab}"))  # fmt: skip
    else:
        n = meta["splits"]["train"]["num_tokens"]
        out.append(CheckResult("data", True, f"{path}: {n:,} train tokens, vocab {vocab} <= "
                               f"model.vocab_size {cfg.model.vocab_size}"))  # fmt: skip
    tok = load_tokenizer(cfg.data.tokenizer)  # a missing tokenizer file raises its own fix
    if tok.name == tok_name:
        out.append(CheckResult("data.tokenizer", True, f"{tok.name} matches the dataset"))
    elif cfg.data.tokenizer == "byte":  # the default: the run records the data's
        spec = meta["tokenizer"].get("spec")
        out.append(CheckResult("data.tokenizer", True, f"dataset prepared with {tok_name}: "
                               f"the run records its tokenizer ({spec})"))  # fmt: skip
    else:
        out.append(CheckResult("data.tokenizer", False, f"{path} was prepared with {tok_name}, "
                               f"data.tokenizer is {tok.name}: re-prepare the data or fix data.tokenizer"))  # fmt: skip
    return out


def _writable(path: Path) -> tuple[Path, str]:
    """The nearest existing ancestor of `path` and why `path` cannot be written there ('' when
    it can). Probes with a real file: permission bits say nothing for root or a read-only
    mount. Creates nothing that outlives the probe."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return p, f"{p} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".wanka-preflight-"):
            pass
    except OSError as e:
        return p, f"cannot write in {p} ({e.strerror})"
    return p, ""


def size_text(n: float) -> str:
    """Bytes for a message, precise at every scale: GiB from 1 GiB on, MiB below (a 37 MB disk
    is never "0.0 GiB free"), KiB below 1 MiB."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def replaced_checkpoints(cfg, root: Path) -> list[Path]:
    """The complete checkpoints in `root` that new saves prune (keep = checkpoint.keep):
    every one when the job resumes from 'latest'; with checkpoint.load naming one of them,
    those up to it (the newer ones are moved aside and kept, train/checkpoint.py supersede);
    none when it names another run's checkpoint."""
    from wanka.train.checkpoint import Checkpointer, complete_checkpoints

    done = complete_checkpoints(root)
    load = cfg.checkpoint.load
    if load == "latest":
        return done
    if load == "none":
        return []
    try:
        here = Path(load).resolve().parent == root.resolve()
    except OSError:
        here = False
    step = Checkpointer.step_of(Path(load))
    return [p for p in done if here and Checkpointer.step_of(p) <= step]


def _check_checkpoint(cfg) -> CheckResult:
    ck = cfg.checkpoint
    if ck.load not in ("latest", "none") and not Path(ck.load).is_dir():
        return CheckResult("checkpoint", False, f"checkpoint.load={ck.load!r} is not a "
                           "directory: point it at a checkpoint or use 'latest'/'none'")  # fmt: skip
    if ck.init_weights and not Path(ck.init_weights).is_dir():  # (train refused it; check passed)
        return CheckResult("checkpoint", False, f"checkpoint.init_weights={ck.init_weights!r} "
                           "is not a directory: point it at a run directory or one of its "
                           "checkpoints")  # fmt: skip
    if not ck.enable:
        return CheckResult("checkpoint", True, "checkpoints disabled (checkpoint.enable=false)",
                           warn=True)  # fmt: skip
    root = Path(cfg.run.dir) / "checkpoints"
    anchor, why = _writable(root)
    if why:
        return CheckResult("checkpoint", False, f"{root} is not writable: {why}; set run.dir "
                           "to a writable directory")  # fmt: skip
    size = checkpoint_bytes(cfg)
    # What is on disk already counts: the checkpoints new saves replace (pruned to keep) and
    # the partial folders of saves that never finished (removed before any new save). At most
    # keep + 1 checkpoints are on disk at once (the newest being written), and the first new
    # save is written before an existing one goes.
    existing = replaced_checkpoints(cfg, root)
    sizes = [_tree_bytes(p) for p in existing]
    if sizes:
        size = max(size, sizes[-1])  # the newest real one: DCP's files, metadata, manifest
    held = sum(sizes)
    from wanka.train.checkpoint import PARTIAL

    partial = sum(_tree_bytes(p) for p in root.glob(PARTIAL + "*")) if root.is_dir() else 0
    need = max(size, (ck.keep + 1) * size - held) - partial
    free = shutil.disk_usage(anchor).free
    msg = f"{root}: {ck.keep + 1} x {size_text(size)} needed"
    if held or partial:
        kept = f"{len(sizes)} existing checkpoint(s) ({size_text(held)}) that new saves replace"
        gone = f"unfinished saves ({size_text(partial)}) removed first"
        parts = [kept] * bool(held) + [gone] * bool(partial)
        msg += f" ({size_text(max(need, 0))} beyond the {' and '.join(parts)})"
    msg += f", {size_text(free)} free"
    if free < need:
        return CheckResult("checkpoint", False, msg + ": free disk space, lower checkpoint.keep "
                           "or move run.dir")  # fmt: skip
    if ck.every > cfg.train.steps:
        return CheckResult("checkpoint", True, msg + f"; checkpoint.every={ck.every} > "
                           f"train.steps: no checkpoint before the end", warn=True)  # fmt: skip
    return CheckResult("checkpoint", True, msg)


def _check_snapshot(cfg, world_size: int, nnodes: int) -> CheckResult:
    r = cfg.resilience
    if r.snapshot_every <= 0:
        return CheckResult("snapshot", True, "in-memory snapshots off")
    root = Path(r.snapshot_dir)
    anchor, why = _writable(root)
    if why:
        return CheckResult("snapshot", False, f"{root} is not writable: {why}; set "
                           "resilience.snapshot_dir (e.g. /dev/shm/wanka)")  # fmt: skip
    # A rank's snapshot is its shard of fp32 params + 2 moments; each rank keeps 2, and with
    # replicas a node also holds 2 of each buddy rank's on another node.
    per_rank = param_counts(cfg).total * 12 // _dims(cfg, world_size).replica_size
    copies = 2 * (2 if r.snapshot_replica and nnodes > 1 else 1)
    need = copies * per_rank * (world_size // max(nnodes, 1))
    free = shutil.disk_usage(anchor).free
    msg = f"{root}: {size_text(need)} needed per node, {size_text(free)} free"
    if free < need:
        return CheckResult("snapshot", False, msg + ": grow the tmpfs, move "
                           "resilience.snapshot_dir or set resilience.snapshot_every=0 (off)")  # fmt: skip
    return CheckResult("snapshot", True, msg)


def preflight(cfg, nproc: int, nnodes: int = 1, live: bool = False, rdzv: dict | None = None,
              capacity_bytes: int | None = None, timeout_s: float = 60.0) -> PreflightReport:  # fmt: skip
    """Static checks for a job of nproc x nnodes ranks, then (live=True) the live checks."""
    t0 = time.perf_counter()
    results = static_checks(cfg, nproc * nnodes, nnodes, capacity_bytes)
    if live:
        rdzv = dict(rdzv or {})
        if rdzv.get("nnodes") is None:
            rdzv["nnodes"] = nnodes
        results += live_checks(cfg, nproc, rdzv, timeout_s)
    return PreflightReport(results, time.perf_counter() - t0)


# Live checks live in their own module; re-exported for callers of this one.
from wanka.resilience.preflight_live import collate, link_rounds, live_checks, live_rank  # noqa: E402

__all__ = [
    "CheckResult",
    "PreflightReport",
    "collate",
    "link_rounds",
    "live_checks",
    "live_rank",
    "preflight",
    "static_checks",
]
