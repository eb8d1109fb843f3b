"""Validate parallel degrees against the world size and build the device meshes once.

Layout (TorchTitan-style): the world is dp_shard x cp ranks (cp innermost, so a context-parallel
group sits inside a node and data parallelism goes across). FSDP2 shards every parameter over
all of them (`fsdp`, the flattened dp x cp). `dp` splits the batch; `cp` splits each sequence
(distributed/context_parallel.py). Expert parallelism borrows its ranks from dp x cp: the world
is also viewed as (dp_mod_ep, ep), experts are split over `ep` and FSDP-sharded over
`dp_mod_ep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelError(ValueError):
    pass


@dataclass
class ParallelDims:
    dp_shard: int
    ep: int
    world_size: int
    cp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _gather: dict = field(default_factory=dict, repr=False)

    @classmethod
    def resolve(cls, dp_shard: int, ep: int, world_size: int, cp: int = 1) -> ParallelDims:
        if cp <= 0:
            raise ParallelError(f"parallel.cp={cp} must be positive (1 = no context parallelism)")
        if world_size % cp != 0:
            raise ParallelError(
                f"parallel.cp={cp} must divide the world size {world_size} (launch a multiple "
                f"of {cp} ranks with --nproc, or lower parallel.cp)"
            )
        if dp_shard == -1:
            dp_shard = world_size // cp
        if dp_shard <= 0 or ep <= 0:
            raise ParallelError(
                f"parallel.dp_shard={dp_shard} and parallel.ep={ep} must be positive"
            )
        if dp_shard * cp != world_size:
            raise ParallelError(
                f"parallel.dp_shard={dp_shard} x parallel.cp={cp} does not match the world size "
                f"{world_size} (set parallel.dp_shard=-1 or launch {dp_shard * cp} ranks with "
                "--nproc)"
            )
        if world_size % ep != 0:
            raise ParallelError(
                f"parallel.ep={ep} must divide parallel.dp_shard x parallel.cp = {world_size} "
                "(expert parallelism borrows its ranks from data and context parallelism)"
            )
        return cls(dp_shard, ep, world_size, cp)

    @property
    def dp_mod_ep(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def build_meshes(self, device_type: str) -> None:
        """Create the meshes (and their process groups) exactly once."""
        if self._meshes:
            return
        flat = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("fsdp",))
        batch = flat._unflatten("fsdp", (self.dp_shard, self.cp), ("dp", "cp"))
        experts = flat._unflatten("fsdp", (self.dp_mod_ep, self.ep), ("dp_mod_ep", "ep"))
        # Gather blocks of 2 cp, 4 cp, ... consecutive ranks that a dynamic CP plan may pick
        # for a step (cp_plan); created up front because every rank must create every group.
        self._gather = {self.cp: batch["cp"].get_group()} if self.cp_enabled else {}
        span = 2 * self.cp
        while self.cp_enabled and span <= self.world_size and self.world_size % span == 0:
            # Its own group even at span = world: FSDP's collectives use the flat one.
            blocks = flat._unflatten("fsdp", (self.world_size // span, span),
                                     (f"gather{span}_blocks", f"gather{span}"))  # fmt: skip
            self._gather[span] = blocks[f"gather{span}"].get_group()
            span *= 2
        self._meshes = {
            "world": flat,
            "fsdp": flat,
            "dp": batch["dp"],
            "cp": batch["cp"],
            "ep": experts["ep"],
            "dp_mod_ep": experts["dp_mod_ep"],
        }

    def gather_groups(self) -> dict:
        """{span: this rank's process group of the aligned block of span consecutive ranks}
        for span = cp, 2 cp, 4 cp, ... dividing the world (empty without CP)."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called")
        return dict(self._gather)

    def mesh(self, name: str) -> DeviceMesh:
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called")
        return self._meshes[name]
