"""Validate parallel degrees against the world size and build the device meshes once.

Layout (TorchTitan-style): the world is dp_replicate x dp_shard x cp ranks, cp innermost (a
context-parallel group sits inside a node), replicas outermost (one replica per node or group
of nodes). FSDP2 shards every parameter over the dp_shard x cp ranks of a replica (`shard`) and
replicates it across replicas (`replicate`): HSDP, the 2D mesh `fsdp`; with one replica `fsdp`
is the flat world. `dp` (= dp_replicate x dp_shard ranks) splits the batch; `cp` splits each
sequence (distributed/context_parallel.py). Expert parallelism borrows its ranks from a
replica's dp_shard x cp: a replica is also viewed as (dp_mod_ep, ep), experts are split over
`ep` and FSDP-sharded over `dp_mod_ep` (and replicated across replicas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelError(ValueError):
    pass


def gather_spans(world_size: int, cp: int) -> list[int]:
    """The gather blocks a CP plan may use: cp, 2 cp, 4 cp, ... consecutive ranks dividing the
    world (none without CP)."""
    spans, span = [], cp
    while cp > 1 and span <= world_size and world_size % span == 0:
        spans.append(span)
        span *= 2
    return spans


@dataclass
class ParallelDims:
    dp_shard: int
    ep: int
    world_size: int
    cp: int = 1
    dp_replicate: int = 1
    ranks_per_node: int = 0  # 0: unknown (no hierarchical expert all-to-all)
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _gather: dict = field(default_factory=dict, repr=False)

    @classmethod
    def resolve(cls, dp_shard: int, ep: int, world_size: int, cp: int = 1,
                dp_replicate: int = 1) -> ParallelDims:  # fmt: skip
        if cp <= 0:
            raise ParallelError(f"parallel.cp={cp} must be positive (1 = no context parallelism)")
        if dp_replicate <= 0:
            raise ParallelError(
                f"parallel.dp_replicate={dp_replicate} must be positive (1 = no HSDP)"
            )
        if world_size % (cp * dp_replicate) != 0:
            raise ParallelError(
                f"parallel.dp_replicate={dp_replicate} x parallel.cp={cp} must divide the world "
                f"size {world_size} (launch a multiple of {cp * dp_replicate} ranks with --nproc, "
                "or lower them)"
            )
        if dp_shard == -1:
            dp_shard = world_size // (cp * dp_replicate)
        if dp_shard <= 0:
            raise ParallelError(f"parallel.dp_shard={dp_shard} must be positive, or -1 (every "
                                "rank the other degrees leave)")  # fmt: skip
        if ep <= 0:
            raise ParallelError(f"parallel.ep={ep} must be positive (1 = no expert parallelism)")
        if dp_replicate * dp_shard * cp != world_size:
            raise ParallelError(
                f"parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard} x "
                f"parallel.cp={cp} does not match the world size {world_size} (set "
                f"parallel.dp_shard=-1 or launch {dp_replicate * dp_shard * cp} ranks with --nproc)"
            )
        replica = dp_shard * cp
        if replica % ep != 0:
            raise ParallelError(
                f"parallel.ep={ep} must divide parallel.dp_shard x parallel.cp = {replica} "
                "(expert parallelism borrows its ranks from data and context parallelism"
                + (", inside one HSDP replica)" if dp_replicate > 1 else ")")
            )
        return cls(dp_shard, ep, world_size, cp, dp_replicate)

    @classmethod
    def from_config(cls, par, world_size: int, ranks_per_node: int = 0) -> ParallelDims:
        """From a ParallelConfig (config/schema.py)."""
        dims = cls.resolve(par.dp_shard, par.ep, world_size, par.cp, par.dp_replicate)
        dims.ranks_per_node = ranks_per_node
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many ways the batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def replica_size(self) -> int:
        """Ranks of one HSDP replica (the ranks a parameter is sharded over)."""
        return self.dp_shard * self.cp

    @property
    def dp_mod_ep(self) -> int:
        return self.replica_size // self.ep

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

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
        batch = flat._unflatten("fsdp", (self.dp, self.cp), ("dp", "cp"))
        hsdp = flat._unflatten(
            "fsdp", (self.dp_replicate, self.replica_size), ("replicate", "shard")
        )
        experts = flat._unflatten("fsdp", (self.dp_replicate, self.dp_mod_ep, self.ep),
                                  ("replicate", "dp_mod_ep", "ep"))  # fmt: skip
        # Gather blocks of 2 cp, 4 cp, ... consecutive ranks that a dynamic CP plan may pick
        # for a step (cp_plan); created up front because every rank must create every group.
        spans = gather_spans(self.world_size, self.cp)
        self._gather = {self.cp: batch["cp"].get_group()} if spans else {}
        for span in spans[1:]:
            # Its own group even at span = world: FSDP's collectives use the flat one.
            blocks = flat._unflatten("fsdp", (self.world_size // span, span),
                                     (f"gather{span}_blocks", f"gather{span}"))  # fmt: skip
            self._gather[span] = blocks[f"gather{span}"].get_group()
        if self.ep_spans_nodes:  # each EP group is ep / ranks_per_node whole nodes
            L = self.ranks_per_node
            rails = flat._unflatten("fsdp", (self.dp_replicate, self.dp_mod_ep, self.ep // L, L),
                                    ("replicate", "dp_mod_ep", "ep_inter", "ep_intra"))  # fmt: skip
        self._meshes = {
            "world": flat,
            "fsdp": hsdp if self.hsdp_enabled else flat,  # 2D (replicate, shard) under HSDP
            "shard": hsdp["shard"],
            "replicate": hsdp["replicate"],
            "dp": batch["dp"],
            "cp": batch["cp"],
            "ep": experts["ep"],
            "dp_mod_ep": experts["dp_mod_ep"],
            "experts_fsdp": experts["replicate", "dp_mod_ep"] if self.hsdp_enabled
            else experts["dp_mod_ep"],
            **({"ep_intra": rails["ep_intra"], "ep_inter": rails["ep_inter"]}
               if self.ep_spans_nodes else {}),
        }  # fmt: skip

    @property
    def ep_spans_nodes(self) -> bool:
        L = self.ranks_per_node
        return L > 0 and self.ep > L and self.ep % L == 0 and self.world_size % L == 0

    def ep_hierarchy(self) -> tuple | None:
        """(node group, rail group, ranks per node, local index) of this rank's EP group
        when it spans nodes (distributed/hierarchical_a2a.py), else None."""
        if not self.ep_spans_nodes:
            return None
        intra = self.mesh("ep_intra")
        return (intra.get_group(), self.mesh("ep_inter").get_group(), self.ranks_per_node,
                intra.get_local_rank())  # fmt: skip

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
