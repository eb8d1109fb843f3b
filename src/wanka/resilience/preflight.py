"""Pre-flight: check a job's configuration and its machines before (re)launching it.

Static checks need no processes: parallel degrees, sequence lengths, the per-device memory
estimate against capacity, batch arithmetic, data and tokenizer, room for checkpoints and
in-memory snapshots. Live checks start real ranks (torch elastic, the job's backend) and measure
backend start-up, every link (timed all-reduce on disjoint rank pairs, intra- and inter-node
separately), a short matmul burn-in compared across ranks, and free memory. The supervisor runs
`preflight` before every (re)launch; `wanka check` prints the same report.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from wanka.device import dist_backend, local_device, resolve_device_type, synchronize

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
    return CheckResult("config", True, "fields valid")


def _dims(cfg, world_size: int):
    from wanka.distributed.parallel_dims import ParallelDims

    return ParallelDims.resolve(cfg.parallel.dp_shard, cfg.parallel.ep, world_size)


def _check_degrees(cfg, world_size: int, nnodes: int) -> CheckResult:
    if nnodes <= 0 or world_size % nnodes:
        return CheckResult("parallel.degrees", False, f"{world_size} ranks do not split evenly "
                           f"over {nnodes} nodes: launch the same --nproc on every node")  # fmt: skip
    d = _dims(cfg, world_size)  # ep vs n_experts is the config check's (validate)
    return CheckResult("parallel.degrees", True, f"dp_shard={d.dp_shard} ep={d.ep} "
                       f"(experts {cfg.model.n_experts // d.ep}/rank) over {world_size} ranks "
                       f"= {nnodes} node(s) x {world_size // nnodes}")  # fmt: skip


def _check_sequence(cfg) -> CheckResult:
    m, s = cfg.model, cfg.data.seq_len
    if s > m.max_seq_len:
        return CheckResult("sequence", False, f"data.seq_len={s} > model.max_seq_len="
                           f"{m.max_seq_len}: lower data.seq_len or raise model.max_seq_len")  # fmt: skip
    if m.index_topk > s:
        return CheckResult("sequence", False, f"model.index_topk={m.index_topk} > data.seq_len="
                           f"{s}: sparse attention would be dense; set model.index_topk "
                           f"below {s} or raise data.seq_len")  # fmt: skip
    return CheckResult("sequence", True, f"seq_len {s} <= max_seq_len {m.max_seq_len}; each "
                       f"query attends to top-{m.index_topk} ({m.index_topk / s:.0%})")  # fmt: skip


def _check_batch(cfg, world_size: int) -> CheckResult:
    t = cfg.train
    dp = _dims(cfg, world_size).dp_shard
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


def memory_need_bytes(cfg, world_size: int) -> int:
    """Per-rank estimate for this job: FSDP over dp_shard, no activation checkpointing (the
    trainer does not use it), fp32 on CPU and bf16 compute copies on accelerators."""
    from wanka.device import autocast_dtype
    from wanka.models.stats import memory_estimate

    d = _dims(cfg, world_size)
    dtype = autocast_dtype(resolve_device_type(cfg.run.device), cfg.train.mixed_precision)
    est = memory_estimate(cfg.model, d.dp_shard, d.ep, cfg.data.seq_len,
                          cfg.train.micro_batch_size, activation_checkpointing=False,
                          param_bytes=4 if dtype is None else 2)  # fmt: skip
    return int(est["total"] * GIB)


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
    need = memory_need_bytes(cfg, world_size)
    device_type = resolve_device_type(cfg.run.device)
    where = "given capacity"
    if capacity is None:
        capacity = device_memory(device_type, world_size // max(nnodes, 1))[1]
        where = "RAM available per local rank" if device_type == "cpu" else f"{device_type} memory"
    msg = f"estimate {need / GIB:.2f} GiB/rank vs {capacity / GIB:.2f} GiB {where}"
    if need > capacity:
        return CheckResult("memory", False, msg + ": lower train.micro_batch_size or "
                           "data.seq_len, or add ranks (parallel.dp_shard) / raise parallel.ep")  # fmt: skip
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
    elif cfg.data.tokenizer == "byte":  # the default; training reads ids only, so just a hint
        out.append(CheckResult("data.tokenizer", True, f"dataset prepared with {tok_name}, "
                               "data.tokenizer is 'byte': set it to that tokenizer.json", warn=True))  # fmt: skip
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


def _check_checkpoint(cfg) -> CheckResult:
    ck = cfg.checkpoint
    if ck.load not in ("latest", "none") and not Path(ck.load).is_dir():
        return CheckResult("checkpoint", False, f"checkpoint.load={ck.load!r} is not a "
                           "directory: point it at a checkpoint or use 'latest'/'none'")  # fmt: skip
    if not ck.enable:
        return CheckResult("checkpoint", True, "checkpoints disabled (checkpoint.enable=false)",
                           warn=True)  # fmt: skip
    root = Path(cfg.run.dir) / "checkpoints"
    anchor, why = _writable(root)
    if why:
        return CheckResult("checkpoint", False, f"{root} is not writable: {why}; set run.dir "
                           "to a writable directory")  # fmt: skip
    size = param_counts(cfg).total * 12  # fp32 params + 2 Adam moments (DCP, unsharded total)
    need, free = (ck.keep + 1) * size, shutil.disk_usage(anchor).free
    msg = f"{root}: {ck.keep + 1} x {size / GIB:.2f} GiB needed, {free / GIB:.1f} GiB free"
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
    per_rank = param_counts(cfg).total * 12 // _dims(cfg, world_size).dp_shard
    copies = 2 * (2 if r.snapshot_replica and nnodes > 1 else 1)
    need = copies * per_rank * (world_size // max(nnodes, 1))
    free = shutil.disk_usage(anchor).free
    msg = f"{root}: {need / GIB:.2f} GiB needed per node, {free / GIB:.1f} GiB free"
    if free < need:
        return CheckResult("snapshot", False, msg + ": grow the tmpfs, move "
                           "resilience.snapshot_dir or set resilience.snapshot_every=0 (off)")  # fmt: skip
    return CheckResult("snapshot", True, msg)


# ---------------------------------------------------------------- live checks (every rank)


def _ring_rounds(members: list[int]) -> list[list[tuple[int, int]]]:
    """The ring's links (m0-m1, m1-m2, ..., last-m0) in rounds of disjoint pairs, so that each
    rank is in at most one timed all-reduce at a time and every link is measured alone."""
    k = len(members)
    if k < 2:
        return []
    if k == 2:
        return [[(members[0], members[1])]]
    edges = [(members[j], members[(j + 1) % k]) for j in range(k)]
    even = k - k % 2
    rounds = [edges[0:even:2], edges[1:even:2]]
    return rounds + ([[edges[-1]]] if k % 2 else [])


def link_rounds(where: list[tuple[str, int]]) -> dict[str, list[list[tuple[int, int]]]]:
    """Pairs per link class from each rank's (node, local rank): a ring over each node's ranks
    (intra_node) and a ring over the nodes for each local rank (inter_node)."""
    nodes = sorted(
        {n for n, _ in where}, key=lambda n: min(r for r, w in enumerate(where) if w[0] == n)
    )
    rings = {"intra_node": [[r for r, w in enumerate(where) if w[0] == n] for n in nodes],
             "inter_node": [[r for n in nodes for r, w in enumerate(where) if w == (n, lr)]
                            for lr in sorted({lr for _, lr in where})]}  # fmt: skip
    out: dict[str, list[list[tuple[int, int]]]] = {}
    for cls, ring_list in rings.items():
        per_ring = [_ring_rounds(m) for m in ring_list]
        n_rounds = max((len(x) for x in per_ring), default=0)
        rounds = [[p for x in per_ring if i < len(x) for p in x[i]] for i in range(n_rounds)]
        if rounds:
            out[cls] = rounds
    return out


def _time_pair(pair: tuple[int, int], device: torch.device, nbytes: int, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        # Only the two members take part in creating their group: O(1) per link, not O(world).
        g = dist.new_group(list(pair), timeout=timedelta(seconds=timeout_s),
                           use_local_synchronization=True)  # fmt: skip
        x = torch.ones(nbytes // 4, device=device)
        dist.all_reduce(x, group=g)  # warm-up: connection set-up is not link speed
        synchronize(device)
        iters, t1 = 3, time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=g)
        synchronize(device)
        dt = time.perf_counter() - t1
        # Bus bandwidth of a 2-rank all-reduce equals the algorithm bandwidth: bytes / time.
        return {"pair": pair, "gbps": nbytes * iters / dt / 1e9, "error": ""}
    except Exception as e:  # noqa: BLE001  (a broken link is a result, not a crash)
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return {"pair": pair, "gbps": None, "error": f"{err} after {time.perf_counter() - t0:.1f}s"}


def _burn_in(device: torch.device, rank: int, seconds: float) -> float:
    """GFLOP/s of back-to-back matmuls: the best of many short chunks. Contention from other
    processes only ever slows a chunk down, so the best chunk is what the device can do; a slow
    device (throttled, degraded, injected) is slow in every chunk."""
    n = 256 if device.type == "cpu" else 2048
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    slow = os.environ.get(SLOW_RANK_ENV) == str(rank)
    factor = float(os.environ.get(SLOW_FACTOR_ENV, "0.25"))
    (a @ b).sum().item()
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 3:
        t0 = time.perf_counter()
        for _ in range(8):
            c = a @ b
        synchronize(device)
        if slow:  # injected fault: stretch this chunk so the rank runs at `factor` speed
            time.sleep((time.perf_counter() - t0) * (1 / factor - 1))
        rates.append(8 * 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    del c
    return max(rates)


def live_rank(device_request: str = "auto", timeout_s: float = 60.0,
              burn_in_s: float = 0.3) -> list[dict]:  # fmt: skip
    """One rank's live checks (run under torchrun/elastic: RANK, WORLD_SIZE, ... are set).
    Returns every rank's record, in rank order, on every rank."""
    device_type = resolve_device_type(device_request)
    t0 = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device_type), timeout=timedelta(seconds=timeout_s))
    init_s = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = local_device(device_type)
    if device_type == "cpu":  # ranks of a node share its cores: an equal share each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # GROUP_RANK (torch elastic's node index), not the hostname: cluster-in-a-box nodes are
    # network namespaces of one host and share its name.
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    where: list = [None] * world
    dist.all_gather_object(where, (node, local_rank))
    where = [tuple(w) for w in where]
    links = []
    nbytes = 4 << 20 if device.type == "cpu" else 256 << 20
    for cls, rounds in link_rounds(where).items():
        for pairs in rounds:
            for pair in (p for p in pairs if rank in p):
                res = _time_pair(pair, device, nbytes, timeout_s / 3)
                if rank == pair[0]:
                    links.append({"cls": cls, **res})
            dist.barrier()  # the next round starts together: pairs never overlap
    dist.barrier()
    gflops = _burn_in(device, rank, burn_in_s)
    free = device_memory(device_type, local_world, device.index or 0)[0]
    rec = {"rank": rank, "node": node, "init_s": init_s, "links": links, "gflops": gflops,
           "free": free}  # fmt: skip
    records: list = [None] * world
    dist.all_gather_object(records, rec)
    dist.destroy_process_group()
    return records


def _live_entry(device_request: str, timeout_s: float) -> list[dict]:
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    return live_rank(device_request, timeout_s)


def _launch_config(nproc: int, rdzv: dict | None, timeout_s: float, start_method: str):
    from torch.distributed.launcher.api import LaunchConfig

    given = {k: v for k, v in (rdzv or {}).items() if v is not None}
    nn = str(given.get("nnodes", 1)).split(":")
    endpoint = given.get("rdzv_endpoint") or (
        f"{given['master_addr']}:{given.get('master_port', 29500)}" if "master_addr" in given
        else "localhost:0")  # fmt: skip
    backend = given.get("rdzv_backend") or ("static" if "node_rank" in given else "c10d")
    conf: dict = {"join_timeout": int(timeout_s)}
    if backend == "static":
        conf["rank"] = int(given.get("node_rank", 0))
    return LaunchConfig(min_nodes=int(nn[0]), max_nodes=int(nn[-1]), nproc_per_node=nproc,
                        run_id=str(given.get("rdzv_id") or f"preflight-{uuid.uuid4().hex[:8]}"),
                        rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=conf,
                        max_restarts=0, monitor_interval=0.05, start_method=start_method)  # fmt: skip


def collate(records: list[dict], need_bytes: int | None = None) -> list[CheckResult]:
    """Every rank's live record -> one result per check, naming the rank and node at fault."""
    out = []
    slowest = max(records, key=lambda r: r["init_s"])
    out.append(CheckResult("backend.init", True, f"{len(records)} ranks up; slowest rank "
                           f"{slowest['rank']} in {slowest['init_s']:.2f}s",
                           warn=slowest["init_s"] > 30))  # fmt: skip
    links = [lk for r in records for lk in r["links"]]
    for cls in ("intra_node", "inter_node"):
        mine = [lk for lk in links if lk["cls"] == cls]
        if not mine:
            continue
        name, node = f"link.{cls}", {r["rank"]: r["node"] for r in records}
        broken = [lk for lk in mine if lk["gbps"] is None]
        if broken:
            a, b = broken[0]["pair"]
            out.append(CheckResult(name, False, f"all-reduce rank {a} (node {node[a]}) <-> rank "
                                   f"{b} (node {node[b]}) failed: {broken[0]['error']}; check "
                                   f"that link/NIC or evict the node ({len(broken)} broken)"))  # fmt: skip
            continue
        med = statistics.median(lk["gbps"] for lk in mine)
        worst = min(mine, key=lambda lk: lk["gbps"])
        a, b = worst["pair"]
        ratio = worst["gbps"] / med
        msg = (f"{len(mine)} pair(s), median {med:.2f} GB/s, slowest rank {a}<->{b} "
               f"{worst['gbps']:.2f} GB/s ({ratio:.2f}x)")  # fmt: skip
        if ratio * SLOW_LINK_FACTOR < 1:
            out.append(CheckResult(name, False, msg + f": more than {SLOW_LINK_FACTOR:g}x slower "
                                   f"than its peers; check the link of node {node[a]}/{node[b]}"))  # fmt: skip
        else:
            out.append(CheckResult(name, True, msg, warn=ratio < WARN_LINK_RATIO))
    med = statistics.median(r["gflops"] for r in records)
    slow = [r for r in records if r["gflops"] < SLOW_DEVICE_RATIO * med]
    low = min(records, key=lambda r: r["gflops"])
    msg = (f"median {med:.1f} GFLOP/s; slowest rank {low['rank']} (node {low['node']}) "
           f"{low['gflops']:.1f} ({low['gflops'] / med:.2f}x)")  # fmt: skip
    if slow:
        ranks = ", ".join(f"rank {r['rank']} (node {r['node']}) {r['gflops'] / med:.2f}x"
                          for r in slow)  # fmt: skip
        out.append(CheckResult("compute.burn_in", False, f"slow device(s) below "
                               f"{SLOW_DEVICE_RATIO}x the median: {ranks}; drain or evict that "
                               "node"))  # fmt: skip
    else:
        out.append(CheckResult("compute.burn_in", True, msg, warn=low["gflops"] < 0.8 * med))
    low = min(records, key=lambda r: r["free"])
    msg = f"least free: rank {low['rank']} (node {low['node']}) {low['free'] / GIB:.2f} GiB"
    if need_bytes is not None and low["free"] < need_bytes:
        out.append(CheckResult("memory.free", False, msg + f" < {need_bytes / GIB:.2f} GiB "
                               "estimated: free memory on that node (stray processes?) or shrink the job"))  # fmt: skip
    else:
        out.append(CheckResult("memory.free", True, msg))
    return out


def live_checks(cfg, nproc: int, rdzv: dict | None = None,
                timeout_s: float = 60.0) -> list[CheckResult]:  # fmt: skip
    """Start `nproc` ranks on this node (and meet the other nodes' ranks through `rdzv`, the
    `wanka train` rendezvous flags), run `live_rank` on each and collate the records."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    t0 = time.perf_counter()
    try:
        nnodes = int(str((rdzv or {}).get("nnodes") or 1).split(":")[-1])
        need: int | None = memory_need_bytes(cfg, nproc * nnodes)
    except Exception:  # noqa: BLE001  (bad degrees are reported by the static checks)
        need = None
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)  # its INFO lines would drown the report
    try:
        # fork on CPU: the ranks start in milliseconds instead of re-importing torch (seconds).
        # Accelerators need spawn: the parent may have initialised CUDA for the memory check.
        cpu = resolve_device_type(cfg.run.device) == "cpu"
        lc = _launch_config(nproc, rdzv, timeout_s, "fork" if cpu else "spawn")
        per_local = elastic_launch(lc, _live_entry)(cfg.run.device, timeout_s)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()))
        return [CheckResult("live", False, f"rank {first.rank} failed (exit {first.exitcode}): "
                            f"{str(first.message).splitlines()[0] if first.message else 'see its log'}; "
                            "fix that node or evict it", time.perf_counter() - t0)]  # fmt: skip
    except Exception as e:  # noqa: BLE001  (rendezvous time-out, launcher error)
        return [CheckResult("live", False, f"could not start {nproc} ranks: {type(e).__name__}: "
                            f"{e}", time.perf_counter() - t0)]  # fmt: skip
    finally:
        elastic_log.setLevel(level)
    out = collate(per_local[min(per_local)], need)
    for r in out:
        r.seconds = time.perf_counter() - t0
    return out


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
