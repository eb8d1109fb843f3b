"""Validate parallel degrees against the world size and build the device meshes once.

Layout (TorchTitan-style): data parallel shards everything with FSDP2 over `dp` ranks.
Expert parallelism borrows its ranks from `dp`: the world is viewed as (dp_mod_ep, ep), experts
are split over `ep` and FSDP-sharded over `dp_mod_ep`; all other parameters are sharded over the
flattened `dp` axis. Context parallelism will add a `cp` axis here.
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
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def resolve(cls, dp_shard: int, ep: int, world_size: int) -> ParallelDims:
        if dp_shard == -1:
            dp_shard = world_size
        if dp_shard <= 0 or ep <= 0:
            raise ParallelError(
                f"parallel.dp_shard={dp_shard} and parallel.ep={ep} must be positive"
            )
        if dp_shard != world_size:
            raise ParallelError(
                f"parallel.dp_shard={dp_shard} does not match the world size {world_size} "
                f"(set parallel.dp_shard=-1 or launch {dp_shard} ranks with --nproc)"
            )
        if dp_shard % ep != 0:
            raise ParallelError(
                f"parallel.ep={ep} must divide parallel.dp_shard={dp_shard} (expert parallelism "
                "borrows its ranks from data parallelism)"
            )
        return cls(dp_shard, ep, world_size)

    @property
    def dp_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_meshes(self, device_type: str) -> None:
        """Create the meshes (and their process groups) exactly once."""
        if self._meshes:
            return
        world = init_device_mesh(
            device_type, (self.dp_mod_ep, self.ep), mesh_dim_names=("dp_mod_ep", "ep")
        )
        self._meshes = {
            "world": world,
            "dp": world["dp_mod_ep", "ep"]._flatten("dp"),
            "ep": world["ep"],
            "dp_mod_ep": world["dp_mod_ep"],
        }

    def mesh(self, name: str) -> DeviceMesh:
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called")
        return self._meshes[name]
