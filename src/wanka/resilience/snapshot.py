"""In-memory snapshots: every rank's state after a step, in shared memory outside the process.

SNAP_DIR/<job>/<node>/rank{R}/step-XXXXXXXX.<layout>.pt holds rank R's *local* shards (model,
optimizer, loader, RNG) as plain tensors: no collective is needed to write one, and a restart
with the same layout reads them back in milliseconds instead of loading a DCP checkpoint.
A copy goes to a buddy rank on another node (SNAP_DIR/<job>/<buddy node>/replica-rank{R}/...),
so losing a node's memory loses nothing. Snapshots are staged synchronously (a clone) and
written and replicated by one background thread on its own gloo group, so the training
collectives never interleave with the replica traffic. DCP checkpoints stay the fallback: they
also load on a different world size, snapshots only on the same layout.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("wanka.snapshot")


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _stage(obj: Any) -> Any:
    """A detached CPU copy of every tensor, DTensors reduced to their local shard."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_stage(v) for v in obj)
    return obj


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> dict:
    return {"model": _stage(model.state_dict()), "optim": _stage(optimizer.state_dict()),
            "rng": torch.get_rng_state(), "extra": extra}  # fmt: skip


@torch.no_grad()
def apply(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copy a captured state back into live model/optimizer (same layout); return `extra`."""
    for name, t in model.state_dict().items():
        _local(t).copy_(state["model"][name])
    # Optimizer state tensors were DTensors shaped like their parameters: rebuild them so.
    params = [p for g in optimizer.param_groups for p in g["params"]]
    osd = state["optim"]
    for idx, st in osd["state"].items():
        p = params[int(idx)]
        for k, v in list(st.items()):
            if (
                isinstance(p, DTensor)
                and isinstance(v, torch.Tensor)
                and v.shape == _local(p).shape
            ):
                st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride(), run_check=False)  # fmt: skip
    optimizer.load_state_dict(osd)
    torch.set_rng_state(state["rng"])
    return state["extra"]


def layout_signature(model: torch.nn.Module, world_size: int, model_config: str = "",
                     parallel: str = "") -> str:  # fmt: skip
    """Snapshots only fit a job with the same world size, parallel layout (which, with the
    global shapes, fixes every rank's shards) and model config (a changed config must meet the
    checkpoint loader's guard, not bypass it)."""
    import hashlib

    # Global shapes (equal on every rank) + world size determine every rank's local shards.
    shapes = ",".join(f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items())
    digest = hashlib.sha256("|".join((shapes, model_config, parallel)).encode()).hexdigest()[:12]
    return f"w{world_size}-{digest}"


class SnapshotStore:
    def __init__(self, root: Path, job: str, node: str, rank: int, world_size: int,
                 local_world_size: int, replica: bool, signature: str, keep: int = 2) -> None:  # fmt: skip
        self.signature = signature  # in every file name: only the same layout restores
        self.job_dir = Path(root) / job
        self.dir = self.job_dir / node / f"rank{rank}"
        self.node, self.rank, self.world, self.keep = node, rank, world_size, keep
        self.dir.mkdir(parents=True, exist_ok=True)
        # Buddy = the same local rank on the next node; only useful with more than one node.
        nodes = max(world_size // max(local_world_size, 1), 1)
        self.send_to = (rank + local_world_size) % world_size if replica and nodes > 1 else None
        self.recv_from = (
            (rank - local_world_size) % world_size if self.send_to is not None else None
        )
        self._group = dist.new_group(backend="gloo") if self.send_to is not None else None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="wanka-snapshot", daemon=True)
        self._thread.start()
        for d in (self.dir, self.dir.parent / f"replica-rank{self.recv_from}"):
            for tmp in d.glob("*.tmp*") if d.is_dir() else ():
                tmp.unlink(missing_ok=True)  # left by a rank killed mid-write

    # -- writing -----------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> None:
        """Queue a staged state; blocks only while the previous snapshot is still in flight."""
        if self._error is not None:
            raise RuntimeError(f"snapshot writer failed: {self._error}")
        self._queue.put((step, state))

    def wait(self) -> None:
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"snapshot writer failed: {self._error}")

    def close(self, discard: bool = False) -> None:
        """Stop the writer; `discard` (the job finished) frees this rank's shared memory."""
        self.wait()
        self._queue.put(None)
        if discard:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.recv_from is not None:
                shutil.rmtree(self.dir.parent / f"replica-rank{self.recv_from}", ignore_errors=True)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                step, state = item
                buf = io.BytesIO()
                torch.save(state, buf)
                payload = buf.getvalue()
                # Exchange first: the buddy waits for us even if our own write then fails
                # (full tmpfs); the failure surfaces as this rank's error, not as a hang.
                if self._group is not None:
                    self._exchange(step, payload)
                _atomic_write(self.dir / self._name(step), payload)
                self._prune(self.dir)
            except BaseException as e:  # surfaced on the next save() in the training thread
                self._error = e
                log.error("snapshot writer: %s", e)
            finally:
                self._queue.task_done()

    def _exchange(self, step: int, payload: bytes) -> None:
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n_out = torch.tensor([out.numel()], dtype=torch.int64)
        n_in = torch.zeros(1, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, n_out, self.send_to, self._group),
               dist.P2POp(dist.irecv, n_in, self.recv_from, self._group)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        inp = torch.empty(int(n_in), dtype=torch.uint8)
        ops = [dist.P2POp(dist.isend, out, self.send_to, self._group),
               dist.P2POp(dist.irecv, inp, self.recv_from, self._group)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        rdir = self.dir.parent / f"replica-rank{self.recv_from}"
        rdir.mkdir(parents=True, exist_ok=True)
        _atomic_write(rdir / self._name(step), inp.numpy().tobytes())
        self._prune(rdir)

    def _name(self, step: int) -> str:
        return f"step-{step:08d}.{self.signature}.pt"

    def _prune(self, d: Path) -> None:
        for old in sorted(d.glob("step-*.pt"))[: -self.keep]:
            old.unlink(missing_ok=True)

    def _steps(self, d: Path) -> list[int]:
        return [
            int(p.name.split(".")[0].split("-")[1]) for p in d.glob(f"step-*.{self.signature}.pt")
        ]

    # -- restoring (collective: every rank calls it) -----------------------------------------
    def restore(self) -> tuple[int, dict] | None:
        """Agree on the newest step every rank can get (own copy or a replica anywhere), fetch
        missing ones from their holders, return (step, state) or None if some rank has none."""
        mine = {"rank": self.rank, "sig": self.signature, "have": {}}
        # What I hold: my own snapshots and the replicas I received (they live on my node).
        mine["have"][self.rank] = self._steps(self.dir)
        if self.recv_from is not None:
            mine["have"][self.recv_from] = self._steps(
                self.dir.parent / f"replica-rank{self.recv_from}"
            )
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if any(g["sig"] != self.signature for g in gathered):
            return None
        holders: dict[int, dict[int, list[int]]] = {}  # owner -> step -> ranks holding it
        for g in gathered:
            for owner, steps in g["have"].items():
                for s in steps:
                    holders.setdefault(int(owner), {}).setdefault(s, []).append(g["rank"])
        common = set.intersection(*(set(holders.get(r, {})) for r in range(self.world)))
        if not common:
            return None
        step = max(common)
        state_bytes = self._fetch(step, holders)
        return step, torch.load(io.BytesIO(state_bytes), weights_only=False)

    def _fetch(self, step: int, holders: dict[int, dict[int, list[int]]]) -> bytes:
        own = self.dir / self._name(step)
        need = [r for r in range(self.world) if r not in holders[r][step]]
        data = own.read_bytes() if self.rank not in need else b""
        for (
            owner
        ) in need:  # the same order on every rank: pairwise transfers over the default group
            src = min(holders[owner][step])
            if self.rank == src:
                payload = (self.dir.parent / f"replica-rank{owner}" / self._name(step)).read_bytes()
                t = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.send(torch.tensor([t.numel()]), owner)
                dist.send(t, owner)
            elif self.rank == owner:
                n = torch.zeros(1, dtype=torch.int64)
                dist.recv(n, src)
                t = torch.empty(int(n), dtype=torch.uint8)
                dist.recv(t, src)
                data = t.numpy().tobytes()
                _atomic_write(own, data)  # it is mine again, for the next fault
        return data


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def drop_node(root: Path, job: str, node: str) -> None:
    """What losing a node does to its memory (used by the chaos drills)."""
    shutil.rmtree(Path(root) / job / node, ignore_errors=True)
