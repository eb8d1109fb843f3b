"""`wanka bench net`: gloo all-reduce / all-gather / all-to-all bandwidth and latency, intra-node
(two ranks on one node, over its loopback) vs inter-node (one rank per node, over the shaped
link), on a cluster-in-a-box of its own (default 2 nodes x 2 ranks). Bus bandwidth follows
nccl-tests: all-reduce x 2(n-1)/n, all-gather and all-to-all x (n-1)/n of size / time, with
size = the all-reduce tensor, the all-gather output, the all-to-all send buffer. send_recv is
one direction between the group's first two ranks: the raw per-direction link rate."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPS = ("all_reduce", "all_gather", "all_to_all", "send_recv")
SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "4K,64K,1M,16M"
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}  # fmt: skip


def parse_sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper().removesuffix("IB").removesuffix("B")
        try:
            out.append(int(float(tok[:-1]) * units[tok[-1]]) if tok[-1] in units else int(tok))
        except (ValueError, IndexError):
            raise ValueError(f"bad --sizes entry {tok!r}: use e.g. 4K,1M,64M") from None
    return out


def fmt_size(n: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}iB"
    return f"{n} B"


# ---- worker (one rank, inside a node) ----


def _op(op: str, size: int, group, n: int, members: list[int]):
    import torch
    import torch.distributed as dist

    elems = max(n, size // 4 // n * n)  # divisible by the group size
    if op == "all_reduce":
        t = torch.ones(elems)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        inp, out = torch.ones(elems // n), torch.empty(elems)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # <2.13
        return lambda: gather(out, inp, group=group)
    if op == "send_recv":
        t, src, dst = torch.ones(size // 4), members[0], members[1]
        if dist.get_rank() == src:
            return lambda: dist.send(t, dst)
        return (lambda: dist.recv(t, src)) if dist.get_rank() == dst else (lambda: None)
    inp, out = torch.ones(elems), torch.empty(elems)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def worker(out: str, sizes: list[int], budget: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per = int(os.environ["LOCAL_WORLD_SIZE"])
    nnodes = world // per
    # Every rank creates every group (collective), then only the measured group works.
    intra = [dist.new_group(list(range(i * per, (i + 1) * per))) for i in range(nnodes)]
    inter = [dist.new_group([i * per + r for i in range(nnodes)]) for r in range(per)]
    scopes = {"intra": (intra[0], list(range(per))),
              "inter": (inter[0], [i * per for i in range(nnodes)])}  # fmt: skip
    rows = []
    for scope, (group, members) in scopes.items():
        n = len(members)
        if n < 2:
            continue
        for op in OPS:
            for size in sizes:
                dist.barrier()
                if rank not in members:
                    continue
                fn = _op(op, size, group, n, members)
                iters = max(2, min(50, budget // size))
                fn()  # warm-up: connections, allocation
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # slowest rank's time
                sec = dt.item()
                alg = size * 8 / sec / 1e9
                rows.append({"op": op, "scope": scope, "ranks": n, "bytes": size, "iters": iters,
                             "lat_us": sec * 1e6, "algbw_gbit": alg,
                             "busbw_gbit": alg * BUS[op](n)})  # fmt: skip
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


# ---- driver ----


def table(res: dict) -> str:
    link = res["link_gbit"]
    lines = ["| op | size | intra lat (µs) | intra busbw (Gbit/s) | inter lat (µs) | "
             "inter busbw (Gbit/s) | inter / link |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    by = {(r["op"], r["scope"], r["bytes"]): r for r in res["rows"]}
    for op in OPS:
        for size in res["sizes"]:
            a, e = by.get((op, "intra", size)), by.get((op, "inter", size))
            if not (a and e):
                continue
            lines.append(f"| {op} | {fmt_size(size)} | {a['lat_us']:.0f} | {a['busbw_gbit']:.2f} | "
                         f"{e['lat_us']:.0f} | {e['busbw_gbit']:.2f} | "
                         f"{e['busbw_gbit'] / link:.0%} |")  # fmt: skip
    return "\n".join(lines)


def _machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                  .splitlines() if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {"nproc": os.cpu_count(), "cpu": model, "kernel": platform.release()}


def run_bench(link_gbit: float = 1.0, sizes: list[int] | None = None, quick: bool = False,
              nproc: int = 2, nodes: int = 2, timeout: float = 900) -> dict:  # fmt: skip
    """Bring up a private cluster (own name, subnet and state dir), run the ranks, tear down."""
    from wanka.cluster import netns as nx
    from wanka.cluster import nodes as nd
    from wanka.cluster import testbed

    why = nx.missing_requirements()
    if why:
        raise ValueError(f"bench net cannot run here: {why}")
    sizes = sizes or parse_sizes(QUICK_SIZES if quick else SIZES)
    budget = (32 if quick else 128) << 20  # bytes per measurement: bounds the time per size
    sdir = tempfile.mkdtemp(prefix="wanka-bench-net-")
    try:
        st = testbed.up(nodes, link_gbit, name="wkb", subnet="10.231.2.0/24", sdir=sdir)
        out = Path(sdir) / "rows.json"
        procs = []
        for i, node in enumerate(st.nodes):
            for r in range(nproc):
                env = dict(os.environ, RANK=str(i * nproc + r), WORLD_SIZE=str(nodes * nproc),
                           LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                           MASTER_ADDR=st.master.addr, MASTER_PORT="29511")  # fmt: skip
                cmd = [sys.executable, "-m", "wanka.bench.net", "--worker", str(out),
                       ",".join(map(str, sizes)), str(budget)]  # fmt: skip
                procs.append(nd.popen(node, cmd, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode for p in procs):
                break
            time.sleep(0.2)
        bad = [p.returncode for p in procs if p.returncode]
        if bad or not out.exists():
            raise ValueError(f"bench net ranks failed (exit {bad or 'timeout'}); see their output")
        rows = json.loads(out.read_text())
    finally:
        for p in locals().get("procs", []):
            if p.poll() is None:
                p.kill()
                p.wait()
        testbed.down(sdir)
        subprocess.run(["rm", "-rf", sdir], check=False)
    return {"bench": "net", "date": datetime.date.today().isoformat(), "machine": _machine(),
            "nodes": nodes, "nproc_per_node": nproc, "link_gbit": link_gbit, "sizes": sizes,
            "rows": rows}  # fmt: skip


def bench_net_main(link_gbit: float = 1.0, sizes: str | None = None, out: str = "runs/bench/net.json",
                   quick: bool = False, nproc: int = 2, nodes: int = 2) -> int:  # fmt: skip
    res = run_bench(link_gbit, parse_sizes(sizes) if sizes else None, quick, nproc, nodes)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wanka bench net: {nodes} nodes x {nproc} ranks, gloo, link {link_gbit:g} Gbit/s "
          f"(tbf), {res['machine']['nproc']} CPUs ({res['machine']['cpu']})")  # fmt: skip
    print(table(res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4]))
