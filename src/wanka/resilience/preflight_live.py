"""Pre-flight live checks, run on every rank: backend start-up, a timed all-reduce on every
link (disjoint rank pairs, intra- and inter-node separately), a matmul burn-in compared across
ranks, free memory. `preflight.live_checks` launches them; `collate` turns the gathered
records into report lines."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from wanka.device import dist_backend, local_device, resolve_device_type, synchronize
from wanka.resilience.preflight import (
    GIB,
    SLOW_DEVICE_RATIO,
    SLOW_FACTOR_ENV,
    SLOW_LINK_FACTOR,
    SLOW_RANK_ENV,
    WARN_LINK_RATIO,
    CheckResult,
    device_memory,
    memory_need_bytes,
)


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
