"""What the engine needs to know about a DeviceMesh: which process group shards,
which replicates (HSDP), this rank's place in each, and the smaller groups that
``reshard_after_forward=<int>`` reshards to."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise.errors import ConfigError, ConfigTypeError

__all__ = ["MeshInfo", "SubgroupInfo", "default_mesh", "mesh_info", "post_forward_subgroup"]


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel layout of a 1-D (shard) or 2-D (replicate, shard) mesh."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    # None for a 1-D mesh; HSDP all-reduces gradients over this group.
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    device: torch.device

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        """DTensor placements of a parameter sharded on ``shard_dim``."""
        if self.replicate_group is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


@dataclass(frozen=True)
class SubgroupInfo:
    """A smaller group inside the shard group (``reshard_after_forward=<int>``)."""

    group: dist.ProcessGroup
    size: int
    rank: int


def _device_type_for_backend() -> str:
    backend = str(dist.get_backend())
    if torch.cuda.is_available() and ("nccl" in backend or "cuda" in backend):
        return "cuda"
    return "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world on the default process group's device type."""
    if not dist.is_initialized():
        raise ConfigError(
            "fully_shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first, or pass mesh=."
        )
    return init_device_mesh(_device_type_for_backend(), (dist.get_world_size(),))


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Validate ``mesh`` and describe its shard / replicate groups."""
    if not isinstance(mesh, DeviceMesh):
        raise ConfigTypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}. Build one with init_device_mesh(...)."
        )
    if mesh.ndim not in (1, 2):
        raise ConfigError(
            f"fully_shard expects a 1-D mesh (shard) or a 2-D mesh (replicate, shard), "
            f"got a {mesh.ndim}-D mesh {tuple(mesh.shape)}. Slice it to the "
            "data-parallel dimensions, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']."
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    if mesh.get_coordinate() is None:
        raise ConfigError(
            f"this rank ({dist.get_rank()}) is not part of mesh {mesh}; every rank "
            "that calls fully_shard must be in the mesh it passes."
        )
    world = dist.get_world_size()
    if mesh.size() > world:
        raise ConfigError(
            f"mesh has {mesh.size()} ranks but the world has only {world}; build the "
            "mesh from the ranks that exist."
        )
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, mesh.size(0), mesh.get_local_rank(0), None, 1, device)
    shard_group = mesh.get_group(1)
    return MeshInfo(
        mesh,
        shard_group,
        mesh.size(1),
        mesh.get_local_rank(1),
        mesh.get_group(0),
        mesh.size(0),
        device,
    )


# Subgroups are collective to create; cache them so that many modules asking for
# the same size share one set of process groups.
_SUBGROUPS: dict[tuple[tuple[int, ...], int], SubgroupInfo] = {}


def post_forward_subgroup(info: MeshInfo, size: int) -> SubgroupInfo:
    """The group of ``size`` consecutive shard-group ranks that this rank belongs to."""
    rows: list[list[int]] = info.mesh.mesh.reshape(-1, info.shard_size).tolist()
    key = (tuple(r for row in rows for r in row), size)
    cached = _SUBGROUPS.get(key)
    if cached is not None:
        return cached
    me = dist.get_rank()
    mine: SubgroupInfo | None = None
    # new_group is collective over the whole world: every rank creates every group.
    for row in rows:
        for start in range(0, len(row), size):
            ranks = row[start : start + size]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = SubgroupInfo(group, size, ranks.index(me))
    if mine is None:
        raise AssertionError(f"rank {me}: not found in any post-forward subgroup of {rows}")
    _SUBGROUPS[key] = mine
    return mine


def resolve_reshard_after_forward(value: object, info: MeshInfo) -> bool | int:
    """Validate ``reshard_after_forward`` and normalise trivial ints to bools."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ConfigError(
            "reshard_after_forward should be a bool, None, or an int giving the group "
            f"size to reshard to after forward, not {value!r}."
        )
    if value < 1 or info.shard_size % value != 0:
        raise ConfigError(
            f"reshard_after_forward={value} must be a positive factor of the shard "
            f"group size {info.shard_size} (e.g. 1, 2, ..., {info.shard_size})."
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 keeps every parameter whole after forward: the "
            "same as reshard_after_forward=False, which is used.",
            stacklevel=3,
        )
        return False
    if value == info.shard_size:
        return True
    return value
