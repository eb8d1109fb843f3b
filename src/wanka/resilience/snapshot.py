"""In-memory snapshots: every rank's state after a step, in shared memory outside the process.

A rank's snapshot lives in two *slots*, files in SNAP_DIR/<job>/<node>/rank{R}/ that the rank
keeps mapped (MAP_SHARED, normally on tmpfs): slot{S}.<layout>.bin holds every tensor of its
*local* state (model and optimizer shards, RNG) back to back, and step-XXXXXXXX.s{S}.<layout>.meta
(pickled: the tensor table, and everything that is not a tensor) commits it. Saving copies the
live tensors straight into the slot the newest snapshot is not in (one memcpy per tensor, no
serialisation), then renames the meta into place: a rank killed mid-copy leaves the other slot
and its meta intact, and the meta of the slot being written is removed before the copy starts.
The pages belong to the file, so they outlive the process. With `overlap` the copy and commit
run on a copier thread under the next step's forward and backward (which only read the state);
the trainer calls `settle()` before the optimizer writes it (the CheckFreq pipeline).

A copy goes to a buddy rank on another node (SNAP_DIR/<job>/<buddy node>/replica-rank{R}/, the
same layout), sent by a background thread on its own gloo group straight from the mapped slot
into the buddy's mapped slot, so losing a node's memory loses nothing; the training thread waits
only if it comes back to a slot whose copy is still in flight. DCP checkpoints stay the
fallback: they also load on a different world size, snapshots only on the same layout.

SNAP_DIR/<job>/job.json (written by the supervisor, and by the ranks where it is missing: a
node's memory is its own) names the job's run directory: the folder is
live while a live job holds that directory's lock, and is swept at any job's start once idle
longer than resilience.snapshot_max_age_h (train/run_lock.py; `wanka clean` by hand).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from wanka.train.run_lock import OWNER, drop_owner_if_alone, write_owner

log = logging.getLogger("wanka.snapshot")
_ALIGN = 64  # every tensor starts on a 64-byte boundary, so any dtype view of the slot is legal


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


class _Ref(NamedTuple):
    """Stands for tensor number `i` of the slot in a meta's pickled skeleton."""

    i: int


def _live(obj: Any) -> Any:
    """The same structure with every tensor as a CPU tensor, no copy on CPU. It runs every
    step over ~300 tensors, so it skips what costs Python time and changes nothing here: the
    autograd wrapper of DTensor.to_local (the states are plain after a step) and detach."""
    if isinstance(obj, torch.Tensor):
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        t = t.detach() if t.requires_grad else t
        return t if t.device.type == "cpu" else t.to("cpu")
    if isinstance(obj, dict):
        return {k: _live(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_live(v) for v in obj)
    return obj


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> dict:
    """A view of a rank's live local state (DTensors reduced to their shards). It aliases the
    model and optimizer on CPU: copy it (SnapshotStore.save does) before the next step.
    keep_vars: the parameters as they are, not detached by state_dict (a DTensor's detach is
    a dispatch of its own, ~100 per step); _live takes their plain local tensors."""
    return {"model": _live(model.state_dict(keep_vars=True)), "optim": _live(optimizer.state_dict()),
            "rng": torch.get_rng_state(), "extra": extra}  # fmt: skip


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple) and not isinstance(obj, _Ref):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_unflatten(v, tensors) for v in obj)
    return obj


def _table(tensors: list[torch.Tensor]) -> tuple[list[tuple], int]:
    """(dtype name, shape, byte offset) per tensor, and the slot size."""
    table, offset = [], 0
    for t in tensors:
        table.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return table, offset


def _views(buf: torch.Tensor, table: list[tuple]) -> list[torch.Tensor]:
    out = []
    for dtype_name, shape, offset in table:
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[offset : offset + n].view(dtype).view(shape))
    return out


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
                 local_world_size: int, replica: bool, signature: str,
                 run_dir: Path | None = None, overlap: bool = False) -> None:  # fmt: skip
        self.signature = signature  # in every file name: only the same layout restores
        self.job_dir = Path(root) / job
        self.dir = self.job_dir / node / f"rank{rank}"
        self.node, self.rank, self.world = node, rank, world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        if run_dir is not None and not (self.job_dir / OWNER).exists():
            # The supervisor's record is in its own host's memory; a node whose memory is its
            # own (another host) gets one from its ranks, for the sweep there.
            write_owner(root, job, run_dir)
        # Buddy = the same local rank on the next node; only useful with more than one node.
        nodes = max(world_size // max(local_world_size, 1), 1)
        self.send_to = (rank + local_world_size) % world_size if replica and nodes > 1 else None
        self.recv_from = (
            (rank - local_world_size) % world_size if self.send_to is not None else None
        )
        self.replica_dir = self.dir.parent / f"replica-rank{self.recv_from}"
        self._maps: dict[Path, torch.Tensor] = {}  # slot file -> its mapping, kept for reuse
        self._views: dict[Path, tuple] = {}  # slot file -> (table, mapping, tensor views)
        self._newest_slot: int | None = None  # known after the first save, else read from disk
        self._free = [threading.Event(), threading.Event()]  # slot not being sent to the buddy
        for ev in self._free:
            ev.set()
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        # The copier (overlap): at most one copy in flight, joined by settle().
        self._copier = ThreadPoolExecutor(1, "wanka-snapshot-copy") if overlap else None
        self._copying: Future | None = None
        if self.send_to is not None:
            self._group = dist.new_group(backend="gloo")
            self._thread = threading.Thread(target=self._loop, name="wanka-snapshot", daemon=True)
            self._thread.start()
        # A snapshot of another layout (world size, degrees, model) cannot restore onto this
        # one: its newest step, for the resume to say what it drops, then it goes.
        self.other_layout_step = max(
            (_meta_step(m) for d in (self.dir, self.replica_dir) if d.is_dir()
             for m in d.glob("step-*.meta") if f".{signature}." not in m.name),
            default=None,
        )  # fmt: skip
        for d in (self.dir, self.replica_dir):
            _sweep(d, signature)

    # -- writing -----------------------------------------------------------------------------
    @torch.no_grad()
    def save(self, step: int, state: dict) -> None:
        """Copy `state` (see capture) into the free slot and commit it; queue the replica. With
        overlap the copy runs on the copier thread: `state` must not change until settle()."""
        self.settle()  # the previous copy first: it decides which slot is free
        if self._error is not None:
            raise RuntimeError(f"snapshot writer failed: {self._error}")
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(state, tensors)
        table, size = _table(tensors)
        slot = self._next_slot(self.dir) if self._newest_slot is None else 1 - self._newest_slot
        self._free[slot].wait()  # its previous contents may still be on their way to the buddy
        for meta in self.dir.glob(f"step-*.s{slot}.{self.signature}.meta"):
            meta.unlink()  # the slot is about to change: it no longer holds that step
        path = self.dir / f"slot{slot}.{self.signature}.bin"
        buf = self._map(path, size)
        views = self._views.get(path)
        if views is None or views[0] != table or views[1] is not buf:
            views = self._views[path] = (table, buf, _views(buf, table))
        # Pickled here, not on the copier: what is not a tensor is taken as it is now.
        meta = pickle.dumps({"step": step, "table": table, "size": size, "skeleton": skeleton})
        if self._copier is None:
            self._copy_and_commit(step, slot, views[2], tensors, meta)
        else:
            self._copying = self._copier.submit(self._copy_and_commit, step, slot, views[2],
                                                tensors, meta)  # fmt: skip

    def _copy_and_commit(self, step: int, slot: int, views: list[torch.Tensor],
                         tensors: list[torch.Tensor], meta: bytes) -> None:  # fmt: skip
        with torch.no_grad():
            torch._foreach_copy_(views, tensors)  # one call: ~300 tensors, little Python
        atomic_write(self.dir / _meta_name(step, slot, self.signature), meta)
        self._newest_slot = slot
        if self._thread is not None:
            self._free[slot].clear()
            self._queue.put((step, slot, meta))

    def copying(self) -> bool:
        """A copy is still running (overlap): settle() would wait."""
        return self._copying is not None and not self._copying.done()

    def settle(self) -> float:
        """Wait for the copy in flight (overlap), if any; re-raises its error. Returns the
        seconds waited (0.0 when it had finished): the stall the overlap did not hide."""
        job, self._copying = self._copying, None
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        waited = 0.0 if job.done() else None
        job.result()
        return waited if waited is not None else time.perf_counter() - t0

    def wait(self) -> None:
        self.settle()
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"snapshot writer failed: {self._error}")

    def close(self, discard: bool = False) -> None:
        """Stop the writer; `discard` (the job finished) frees this rank's shared memory."""
        self.wait()
        if self._copier is not None:
            self._copier.shutdown()
            self._copier = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            # Every rank closes at the same point (end of the job): take the replica group down
            # here, with nothing in flight, rather than in whatever order the process exits.
            dist.destroy_process_group(self._group)
            self._thread = None
        self._maps.clear()
        self._views.clear()
        if discard:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.recv_from is not None:
                shutil.rmtree(self.replica_dir, ignore_errors=True)
            try:  # the last rank out removes the folders
                self.dir.parent.rmdir()
            except OSError:
                pass  # not empty (another rank's) or already gone
            drop_owner_if_alone(self.job_dir)  # and the job's owner record (train/run_lock.py)

    def forget(self) -> None:
        """Uncommit every snapshot this rank holds (its own and its buddy's copy): the job
        went back to an older checkpoint (checkpoint.load), and a restart must not restore
        the history it left. Every rank calls it before its first snapshot."""
        for d in (self.dir, self.replica_dir):
            for meta in d.glob("*.meta") if d.is_dir() else ():
                meta.unlink(missing_ok=True)

    def _next_slot(self, d: Path) -> int:
        """The slot the newest committed snapshot in `d` is not in."""
        newest = max(_committed(d, self.signature), default=None)
        return 0 if newest is None else 1 - newest[1]

    def _map(self, path: Path, size: int) -> torch.Tensor:
        """The slot file mapped shared (what is written there outlives this process)."""
        buf = self._maps.get(path)
        # A mapping of a file that was removed (node memory lost) writes into nothing.
        if buf is None or buf.numel() != size or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and path.stat().st_size != size:
                path.unlink()  # the state's layout changed (e.g. optimizer state appeared)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # Reserve the blocks now: a full tmpfs then fails here with ENOSPC (an error
                # the trainer reports) instead of SIGBUS on a later write through the mapping.
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            self._maps[path] = buf
        return buf

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                step, slot, meta = item
                self._exchange(step, slot, meta)
            except BaseException as e:  # surfaced on the next save() in the training thread
                self._error = e
                log.error("snapshot replica: %s", e)
            finally:
                if item is not None:
                    self._free[item[1]].set()
                self._queue.task_done()

    def _exchange(self, step: int, slot: int, meta: bytes) -> None:
        """Send my slot to my buddy while receiving the same step from the rank I back up."""
        out_meta = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        out = self._maps[self.dir / f"slot{slot}.{self.signature}.bin"]
        sizes_out = torch.tensor([out_meta.numel(), out.numel(), slot], dtype=torch.int64)
        sizes_in = torch.zeros(3, dtype=torch.int64)
        self._p2p(sizes_out, sizes_in)
        n_meta, n_data, in_slot = (int(x) for x in sizes_in)
        for old in self.replica_dir.glob(f"step-*.s{in_slot}.{self.signature}.meta"):
            old.unlink()
        self.replica_dir.mkdir(parents=True, exist_ok=True)
        inp = self._map(self.replica_dir / f"slot{in_slot}.{self.signature}.bin", n_data)
        inp_meta = torch.empty(n_meta, dtype=torch.uint8)
        self._p2p(out_meta, inp_meta)
        self._p2p(out, inp)  # straight from my mapping into the buddy's
        in_step = pickle.loads(inp_meta.numpy().tobytes())["step"]
        name = _meta_name(in_step, in_slot, self.signature)
        atomic_write(self.replica_dir / name, inp_meta.numpy().tobytes())

    def _p2p(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, out, self.send_to, self._group),
               dist.P2POp(dist.irecv, inp, self.recv_from, self._group)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    # -- restoring (collective: every rank calls it) -----------------------------------------
    def restore(self) -> tuple[int, dict] | None:
        """Agree on the newest step every rank can get (a copy anywhere), fetch missing ones
        from their holders, return (step, state) or None if some rank has none."""
        # Every copy on my node, whoever's: after a hot spare took a lost node's place (or a
        # c10d rendezvous numbered the nodes anew, as under Slurm), my rank may be one this
        # node held another's copies of (its own folder or a replica it received).
        where = self._copies_here()
        mine = {"rank": self.rank, "sig": self.signature, "have": {}}
        for owner, step in where:
            mine["have"].setdefault(owner, []).append(step)
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
        fetched = self._fetch(step, holders, where)
        if fetched is None and where[self.rank, step] == self.dir:
            # The next save must go to the slot that does NOT hold the step we resume from.
            # Left to _next_slot (the slot the newest snapshot is not in), a rank that had
            # committed a newer step than the others (killed peer: it got one step further)
            # would overwrite exactly this snapshot with the first save after the restore, and
            # a second fault before that save commits would find no common step: the job fell
            # back to the newest checkpoint (or step 0) instead of memory.
            self._newest_slot = dict(_committed(self.dir, self.signature))[step]
        return step, self._load(fetched or where[self.rank, step], step)

    def _copies_here(self) -> dict[tuple[int, int], Path]:
        """(owner rank, step) -> the folder on this node holding that committed copy (own
        folders of any rank, replicas received), within world size; my own folder first."""
        node_dir = self.dir.parent
        found: dict[tuple[int, int], Path] = {}
        dirs = [self.dir, *sorted(node_dir.glob("rank*")), *sorted(node_dir.glob("replica-rank*"))]
        for d in dirs:
            try:
                owner = int(d.name.rsplit("rank", 1)[1])
            except ValueError:
                continue
            if not 0 <= owner < self.world:
                continue
            for step, _ in _committed(d, self.signature):
                found.setdefault((owner, step), d)
        return found

    def _fetch(self, step: int, holders: dict[int, dict[int, list[int]]],
               where: dict[tuple[int, int], Path]) -> Path | None:  # fmt: skip
        """Ranks that lack a copy of `step` get it from a holder (pairwise transfers over the
        default group, in the same order on every rank); returns where mine now is, if it was
        fetched."""
        need = [r for r in range(self.world) if r not in holders[r][step]]
        got = None
        for owner in need:
            src = min(holders[owner][step])
            if self.rank == src:
                meta, data = _read(where[owner, step], step, self.signature)
                for payload in (meta, data):
                    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    dist.send(torch.tensor([t.numel()]), owner)
                    dist.send(t, owner)
            elif self.rank == owner:
                parts = []
                for _ in range(2):
                    n = torch.zeros(1, dtype=torch.int64)
                    dist.recv(n, src)
                    t = torch.empty(int(n), dtype=torch.uint8)
                    dist.recv(t, src)
                    parts.append(t)
                # It is mine again, for the next fault: into my free slot, then committed.
                slot = self._newest_slot = self._next_slot(self.dir)
                for meta in self.dir.glob(f"step-*.s{slot}.{self.signature}.meta"):
                    meta.unlink()
                self._map(self.dir / f"slot{slot}.{self.signature}.bin", parts[1].numel()).copy_(
                    parts[1]
                )
                atomic_write(
                    self.dir / _meta_name(step, slot, self.signature), parts[0].numpy().tobytes()
                )
                got = self.dir
        return got

    def _load(self, d: Path, step: int) -> dict:
        meta_bytes, data = _read(d, step, self.signature)
        meta = pickle.loads(meta_bytes)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        # Own storage per tensor: the optimizer keeps what it is given.
        tensors = [v.clone() for v in _views(buf, meta["table"])]
        return _unflatten(meta["skeleton"], tensors)


def _meta_name(step: int, slot: int, signature: str) -> str:
    return f"step-{step:08d}.s{slot}.{signature}.meta"


def _meta_step(meta: Path) -> int:
    try:
        return int(meta.name.split(".")[0].split("-")[1])
    except (IndexError, ValueError):
        return -1


def _committed(d: Path, signature: str) -> list[tuple[int, int]]:
    """(step, slot) of every committed snapshot in `d` whose slot file is whole."""
    out = []
    for meta in d.glob(f"step-*.s?.{signature}.meta") if d.is_dir() else ():
        step_part, slot_part = meta.name.split(".")[:2]
        step, slot = int(step_part.split("-")[1]), int(slot_part[1:])
        data = d / f"slot{slot}.{signature}.bin"
        try:
            size = pickle.loads(meta.read_bytes())["size"]
            if data.stat().st_size == size:
                out.append((step, slot))
        except (OSError, EOFError, pickle.UnpicklingError, KeyError):
            continue  # a meta whose slot is gone or half-written meta: not a snapshot
    return sorted(out)


def _read(d: Path, step: int, signature: str) -> tuple[bytes, bytes]:
    slot = dict(_committed(d, signature))[step]
    meta = (d / _meta_name(step, slot, signature)).read_bytes()
    return meta, (d / f"slot{slot}.{signature}.bin").read_bytes()


def _sweep(d: Path, signature: str) -> None:
    """Remove temporaries of a killed writer and the slots of another layout (dead weight in
    shared memory: a snapshot only restores onto the layout that wrote it)."""
    for p in d.iterdir() if d.is_dir() else ():
        if ".tmp" in p.name or (p.suffix in (".bin", ".meta", ".pt") and signature not in p.name):
            p.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes) -> None:
    """Readers see all of `data` or the file as it was (written aside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def drop_node(root: Path, job: str, node: str) -> None:
    """What losing a node does to its memory (used by the chaos drills)."""
    shutil.rmtree(Path(root) / job / node, ignore_errors=True)


def inventory(node_dir: Path) -> dict[str, dict[int, list[int]]]:
    """What a node's memory holds, by name only (nothing is read but the commit records):
    signature -> owner rank -> committed steps, own folders and replicas alike. A node agent
    publishes it (resilience/host_control.py); `restorable` reads the job's."""
    out: dict[str, dict[int, set[int]]] = {}
    for d in node_dir.glob("*rank*") if node_dir.is_dir() else ():
        try:
            owner = int(d.name.rsplit("rank", 1)[1])
        except ValueError:
            continue
        for meta in d.glob("step-*.s?.*.meta"):
            parts = meta.name.split(".")
            if len(parts) < 4:
                continue
            sig = ".".join(parts[2:-1])
            for step, _ in _committed(d, sig):
                out.setdefault(sig, {}).setdefault(owner, set()).add(step)
    return {sig: {o: sorted(s) for o, s in owners.items()} for sig, owners in out.items()}


def restorable(held: list[dict[str, dict]], world_size: int) -> int | None:
    """The newest step whose snapshot of every rank of a `world_size` job is held somewhere
    among `held` (the inventories of the next attempt's nodes), or None: then the ranks
    resume from the newest DCP checkpoint (the same rule as SnapshotStore.restore)."""
    best = None
    for inv in held:
        for sig in inv:
            if not sig.startswith(f"w{world_size}-"):
                continue
            per_owner = [set() for _ in range(world_size)]
            for node_inv in held:
                for owner, steps in node_inv.get(sig, {}).items():
                    if 0 <= int(owner) < world_size:
                        per_owner[int(owner)].update(steps)
            common = set.intersection(*per_owner) if per_owner else set()
            if common and (best is None or max(common) > best):
                best = max(common)
    return best
