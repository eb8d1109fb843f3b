"""A rank that checks the cluster end to end: gloo all-reduce gives the right sum, and every
rank knows its node. Run under torchrun on every node (`run_on_cluster(P, ["-m",
"wanka.cluster.probe", OUT])`); rank 0 writes what it saw to OUT as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main(out: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    seen: list[dict | None] = [None] * world
    me = {"rank": rank, "node": os.environ.get("WANKA_NODE"), "group_rank":
          int(os.environ["GROUP_RANK"]), "master": os.environ.get("MASTER_ADDR"),
          "sum": t[0].item(), "ok": bool((t == world * (world + 1) / 2).all())}  # fmt: skip
    dist.all_gather_object(seen, me)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()
    return 0 if me["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
