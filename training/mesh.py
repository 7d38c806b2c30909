"""The device mesh of a model-parallel layout, with named dimensions, and where this rank sits in it.

Dimensions, outermost first: `pp` (pipeline stages), `dp_replicate` and
`dp_shard` (data parallel: FSDP2 shards over `dp_shard` and replicates over
`dp_replicate`), `cp` (context, always 1 here: training/layout.py says why) and
`tp` (tensor parallel, innermost, so a TP group is consecutive ranks of one
node). Expert parallelism is carved out of the data-parallel ranks: the
flattened data-parallel dimension `dp` is viewed as `dp_mod_ep x ep`, experts are
sharded over `ep` and their gradients are reduced over `dp_mod_ep` only.

torch's DeviceMesh makes every sub-group; nothing here talks to other ranks
itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.config import ParallelConfig, format_validation_error, raise_problems
from training.layout import EXPERT_MESH_DIMS, MESH_DIMS, Layout, world_problems


class LayoutError(ValueError):
    """The layout does not fit the processes that were started (message: field, value, fix)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every mesh dimension for one world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @classmethod
    def from_config(cls, par: ParallelConfig, world: int, local_world: int) -> ParallelDims:
        """Degrees of `par` on `world` processes (`local_world` per node); LayoutError if they do not fit."""
        where = f"the {world} processes started"
        try:
            raise_problems("parallel", world_problems(par, world, local_world, where))
        except ValueError as err:  # pydantic's ValidationError
            raise LayoutError("; ".join(format_validation_error(err))) from None  # type: ignore[arg-type]
        lo = Layout.of(par, world, local_world)
        # ddp: FSDP2 with shard groups of one rank replicates, as DDP does; fsdp shards over every dp rank
        shard = 1 if lo.zero == 0 else lo.shard
        return cls(lo.pp, lo.dp // shard, shard, lo.cp, lo.tp, lo.ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree (ranks that see different samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Processes the layout needs."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in MESH_DIMS order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def build(self, device_type: str) -> Meshes:
        """Create the meshes and their process groups (a collective on every rank)."""
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        experts = None
        if self.ep > 1:
            experts = init_device_mesh(
                device_type, (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp), mesh_dim_names=EXPERT_MESH_DIMS
            )
        return Meshes(self, world, experts)


@dataclass(frozen=True)
class Meshes:
    """The world mesh and its named sub-meshes."""

    dims: ParallelDims
    world: DeviceMesh
    experts: DeviceMesh | None  # (pp, dp_mod_ep, ep, cp, tp) when expert_parallel > 1

    @cached_property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every dimension (dp = its data-parallel rank; ep, dp_mod_ep too)."""
        local = dict(zip(MESH_DIMS, self.world.get_coordinate() or [0] * len(MESH_DIMS), strict=True))
        local["dp"] = local["dp_replicate"] * self.dims.dp_shard + local["dp_shard"]
        local["ep"] = local["dp"] % self.dims.ep
        local["dp_mod_ep"] = local["dp"] // self.dims.ep
        return local

    @property
    def tp(self) -> DeviceMesh:
        """Tensor-parallel sub-mesh (1-D)."""
        return self.world["tp"]

    @property
    def cp(self) -> DeviceMesh:
        """Context-parallel sub-mesh (1-D; one rank while context parallelism is planned only)."""
        return self.world["cp"]

    @property
    def pp(self) -> DeviceMesh:
        """Pipeline sub-mesh (1-D)."""
        return self.world["pp"]

    @property
    def dp(self) -> DeviceMesh:
        """Data-parallel sub-mesh for FSDP2: (dp_replicate, dp_shard)."""
        return self.world["dp_replicate", "dp_shard"]

    @cached_property
    def dp_flat(self) -> DeviceMesh:
        """All data-parallel ranks of this rank's model replica as one dimension (sample sharding, loss mean)."""
        return self.world["dp_replicate", "dp_shard"]._flatten("dp")  # noqa: SLF001 - torch's own flattening

    @property
    def ep(self) -> DeviceMesh | None:
        """Expert-parallel sub-mesh (1-D), None without expert parallelism."""
        return self.experts["ep"] if self.experts is not None else None

    @property
    def expert_dp(self) -> DeviceMesh | None:
        """The data-parallel ranks that hold the same experts (the experts' FSDP2 mesh)."""
        return self.experts["dp_mod_ep"] if self.experts is not None else None

    @property
    def is_data_leader(self) -> bool:
        """This rank records its data-parallel rank's samples: first pipeline stage, tensor and context rank 0."""
        c = self.coords
        return c["pp"] == 0 and c["tp"] == 0 and c["cp"] == 0
