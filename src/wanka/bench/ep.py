"""`wanka bench ep`: the expert all-to-all variants side by side on the cluster-in-a-box:
flat, hierarchical (distributed/hierarchical_a2a.py) and flat with the dispatch overlapped
under the shared experts (comm.ep_overlap).

2 nodes x 2 ranks, one EP group of 4 ranks spanning both nodes, links shaped to `--gbit`. Only expert parallelism is applied (no FSDP, no optimizer):
every rank holds the same dense weights, so the step is the MoE model's forward + backward
and its only communication is the expert exchange. Each repeat times every variant once, in
turn (alternating, so load changes hit them alike); step time = the slowest rank's, median
over repeats. Exposed communication = the time each rank's main thread spent blocked in the
expert exchange (expert_parallel.BlockedTimer: the same regions the profiler labels
wanka::ep_a2a*), summed over the timed steps, over their wall time, mean over ranks: host
time, which is what gloo's blocking collectives cost; on NCCL a collective returns at once
and the profiler's device timeline is what to read instead. One more
step per variant runs under torch.profiler; rank 0's trace is saved as JSON for
chrome://tracing / Perfetto (profiling slows the step: its times are not the reported ones).
Gradients of every variant are checked against flat (bitwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from wanka.bench.output import write_out

VARIANTS = {"flat": {}, "hierarchical": {"hierarchical": True}, "overlap": {"overlap": True}}
MODEL = {"dim": 256, "n_layers": 3, "n_dense_layers": 1, "n_heads": 4, "head_dim": 64,
         "n_experts": 16, "n_active_experts": 4, "expert_hidden": 256, "n_shared_experts": 2,
         "index_topk": 64, "mtp_depth": 0}  # fmt: skip
FULL = {"seq_len": 512, "rows": 2, "repeats": 8}
QUICK = {"seq_len": 256, "rows": 1, "repeats": 3}


def _step(model, batch) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    parts = model(*batch)
    (parts.lm_sum / batch[0].numel() + parts.balance).backward()
    return time.perf_counter() - t0


def _slowest(t: float) -> float:
    import torch
    import torch.distributed as dist

    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def _build(dims, variant: dict):
    import torch

    from wanka.config.schema import ModelConfig
    from wanka.distributed.expert_parallel import apply_expert_parallel
    from wanka.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**MODEL))
    model.to_empty(device="cpu")
    model.init_weights(0)
    hier = dims.ep_hierarchy() if variant.get("hierarchical") else None
    if variant.get("hierarchical") and hier is None:
        raise SystemExit("bench ep: the EP group does not span nodes (need 2+ nodes)")
    apply_expert_parallel(model, dims.mesh("ep"), hier, variant.get("overlap", False))
    return model


def _batch(rank: int, rows: int, seq_len: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (rows, seq_len), generator=g)
    positions = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    doc_ids = torch.zeros(rows, seq_len, dtype=torch.int32)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    return tokens, positions, doc_ids, labels


def _trace(model, batch, trace: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, batch)
    prof.export_chrome_trace(str(trace))


def worker(out: Path, seq_len: int, rows: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from wanka.distributed.expert_parallel import BlockedTimer
    from wanka.distributed.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.resolve(-1, world, world)
    dims.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dims.build_meshes("cpu")
    batch = _batch(rank, rows, seq_len)
    models = {name: _build(dims, v) for name, v in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    blocked = dict.fromkeys(VARIANTS, 0.0)
    own = dict.fromkeys(VARIANTS, 0.0)
    for rep in range(repeats + 1):  # the first round warms up
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            BlockedTimer.enabled, BlockedTimer.seconds = rep > 0, 0.0
            t = _step(model, batch)
            if rep:
                blocked[name] += BlockedTimer.seconds
                own[name] += t
                times[name].append(_slowest(t))
    BlockedTimer.enabled = False
    grads = {name: [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    for p in m.parameters() if p.grad is not None] for name, m in models.items()}  # fmt: skip
    same = {name: len(g) == len(grads["flat"]) and all(map(torch.equal, grads["flat"], g))
            for name, g in grads.items()}  # fmt: skip
    exposed = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        _trace(model, batch, out / f"trace_{name}_rank{rank}.json")
        both = torch.tensor([blocked[name], own[name]], dtype=torch.float64)
        dist.all_reduce(both)  # summed over ranks: the fraction is the mean rank's
        exposed[name] = (float(both[0]) / repeats / world, float(both[0] / both[1]))
    flags = torch.tensor([same[name] for name in VARIANTS], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # equal on every rank
    if rank == 0:
        res = {
            name: {
                "step_s": statistics.median(times[name]),
                "steps_s": times[name],
                "exposed_comm_s": exposed[name][0],
                "exposed_fraction": exposed[name][1],
                "bitwise_equal_to_flat": bool(flags[i]),
            }  # fmt: skip
            for i, name in enumerate(VARIANTS)
        }
        (out / "result.json").write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


def table(doc: dict) -> str:
    lines = ["| link | variant | step (s) | vs flat | exposed comm | exposed fraction |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for link in doc["links"]:
        flat = link["variants"]["flat"]["step_s"]
        for name, r in link["variants"].items():
            lines.append(f"| {link['gbit']:g} Gbit/s | {name} | {r['step_s']:.3f} | "
                         f"{flat / r['step_s']:.2f}x | {r['exposed_comm_s']:.3f} s | "
                         f"{r['exposed_fraction']:.0%} |")  # fmt: skip
    return "\n".join(lines)


def bench_ep_main(out: Path, gbits: list[float], quick: bool) -> int:
    import datetime
    import platform

    from wanka.cluster.fixtures import cluster_up
    from wanka.cluster.netns import missing_requirements

    if why := missing_requirements():
        print(f"wanka bench ep: the cluster-in-a-box cannot run here: {why}", file=sys.stderr)
        return 2
    shape = QUICK if quick else FULL
    doc = {"command": " ".join(["wanka", "bench", "ep", *sys.argv[3:]]),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "model": MODEL, "shape": shape, "nodes": 2, "ranks_per_node": 2, "links": []}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    for gbit in gbits:
        with tempfile.TemporaryDirectory(prefix="wanka-bench-ep-") as tmp, \
                cluster_up(2, gbit, name="wkep", subnet="10.231.7.0/24") as cluster:  # fmt: skip
            os.chmod(tmp, 0o777)
            argv = ["-m", "wanka.bench.ep", "--worker", tmp, str(shape["seq_len"]),
                    str(shape["rows"]), str(shape["repeats"])]  # fmt: skip
            rc = cluster.run_on_cluster(2, argv, timeout=1800)
            if rc:
                print(
                    f"wanka bench ep: the run at {gbit:g} Gbit/s failed (exit {rc})",
                    file=sys.stderr,
                )
                return rc
            res = json.loads((Path(tmp) / "result.json").read_text())
            for name in VARIANTS:
                trace = Path(tmp) / f"trace_{name}_rank0.json"
                keep = out.with_name(f"{out.stem}_trace_{name}_{gbit:g}gbit.json")
                keep.write_bytes(trace.read_bytes())
                res[name]["trace"] = str(keep)
            doc["links"].append({"gbit": gbit, "variants": res})
    write_out(out, json.dumps(doc, indent=1))
    print(table(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--worker", nargs=4, metavar=("OUT", "SEQ", "ROWS", "REPEATS"), required=True)
    a = p.parse_args()
    worker(Path(a.worker[0]), int(a.worker[1]), int(a.worker[2]), int(a.worker[3]))
