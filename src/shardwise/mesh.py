"""What the engine needs to know about a DeviceMesh: which process group shards,
which replicates (HSDP), this rank's place in each, and the smaller groups that
``reshard_after_forward=<int>`` reshards to."""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardwise.errors import ConfigError, ConfigTypeError, UnsupportedError, UsageError

__all__ = [
    "DataParallelMeshDims",
    "MeshInfo",
    "SubgroupInfo",
    "default_mesh",
    "join_meshes",
    "mesh_info",
    "post_forward_subgroup",
]


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a whole SPMD mesh are data parallel, for
    ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=...)`` (as PyTorch 2.13
    defines it): parameters are DTensors on that mesh with ``Replicate()`` on
    these dims; FSDP shards over ``shard`` and all-reduces over ``replicate``
    (HSDP). PyTorch's own ``DataParallelMeshDims`` is accepted too.

    Args:
        shard: the mesh dim name FSDP shards over. (Default: ``None``)
        replicate: the mesh dim name gradients are all-reduced over (HSDP).
            (Default: ``None``)
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ConfigError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


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
    # dp_mesh_dims: the whole SPMD mesh parameters live on, the indices of its
    # data-parallel dims, and the index of the one FSDP shards over.
    spmd_mesh: DeviceMesh | None = None
    spmd_dp_dims: frozenset[int] = frozenset()
    spmd_shard_dim: int = -1
    # Parameters replicated over the 1-D ``mesh`` (``Replicate()`` from
    # shard_placement_fn): a one-rank shard group, gradients all-reduced.
    replicate_only: bool = False
    # The mesh the user passed, where the engine's ``mesh`` is another (the
    # wrapper API's): its unnamed 2-D mesh, of which ``mesh`` is a named copy
    # for slicing, so that values stay on the user's own mesh object; or the
    # 1-D mesh of its NO_SHARD, a (replicate, 1) ``mesh`` of its own, which
    # tensor-parallel parameters' meshes are joined with.
    spec_mesh: DeviceMesh | None = None

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard group (what all-gather extensions receive)."""
        if self.spmd_mesh is not None and not self.replicate_only:
            names = self.spmd_mesh.mesh_dim_names or ()
            return self.spmd_mesh[names[self.spmd_shard_dim]]
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names or ()
        return self.mesh[names[-1]]

    @property
    def key(self) -> tuple[int, int]:
        """Which collectives the parameters of this layout share (shard and
        replicate process groups): one parameter group per key."""
        return id(self.shard_group), id(self.replicate_group)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        """DTensor placements of a parameter sharded on ``shard_dim``."""
        if self.replicate_only:
            return (Replicate(),)
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
    # A mesh holds a real table of ranks: made outside a FakeTensorMode (the planner's) if one is active.
    with unset_fake_temporarily():
        return init_device_mesh(_device_type_for_backend(), (dist.get_world_size(),))


def _device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _spmd_mesh_info(mesh: DeviceMesh, dims: object) -> MeshInfo:
    """MeshInfo for ``dp_mesh_dims``: ``mesh`` is the whole SPMD mesh."""
    shard = _names(getattr(dims, "shard", None))
    replicate = _names(getattr(dims, "replicate", None))
    if not shard and not replicate:
        raise ConfigError("At least one of shard or replicate must be set in dp_mesh_dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ConfigError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*shard, *replicate):
        if name not in names:
            raise ConfigError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    both = sorted(set(shard) & set(replicate))
    if both:
        raise UsageError(  # RuntimeError too, as PyTorch's
            f"dp_mesh_dims names {both} as both a shard and a replicate dim; FSDP shards over one "
            "mesh dim and replicates over another: name different dims, e.g. "
            "DataParallelMeshDims(shard='dp_shard', replicate='dp_replicate')."
        )
    if not shard and len(replicate) == 1:  # DDP: whole parameters, gradients all-reduced over the dim
        rep_idx = names.index(replicate[0])
        return dataclasses.replace(
            replicate_info(mesh[replicate[0]]), spmd_mesh=mesh, spmd_dp_dims=frozenset({rep_idx}), spmd_shard_dim=-1
        )
    if len(shard) != 1 or len(replicate) > 1:
        raise UnsupportedError(
            f"dp_mesh_dims with shard={shard} and replicate={replicate}: shardwise shards over "
            "exactly one named dim and replicates over at most one; flatten several dims into "
            "one first (mesh[('a', 'b')]._flatten('dp')) or pass mesh=the data-parallel sub-mesh."
        )
    s_idx = names.index(shard[0])
    r_idx = names.index(replicate[0]) if replicate else None
    shard_mesh = mesh[shard[0]]
    return MeshInfo(
        mesh=shard_mesh if r_idx is None else mesh[(replicate[0], shard[0])],
        shard_group=shard_mesh.get_group(0),
        shard_size=shard_mesh.size(0),
        shard_rank=shard_mesh.get_local_rank(0),
        replicate_group=None if r_idx is None else mesh[replicate[0]].get_group(0),
        replicate_size=1 if r_idx is None else mesh.size(r_idx),
        device=_device_of(mesh),
        spmd_mesh=mesh,
        spmd_dp_dims=frozenset({s_idx} | ({r_idx} if r_idx is not None else set())),
        spmd_shard_dim=s_idx,
    )


def join_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a sharded tensor-parallel parameter: the data-parallel dims
    followed by the TP dims, both sliced from one root mesh."""
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    # UsageError: a ValueError, and a RuntimeError as PyTorch's mesh concatenation raises
    if dp_names is None or tp_names is None or set(dp_names) & set(tp_names):
        raise UsageError(
            f"a tensor-parallel parameter lives on mesh {tp_mesh} and fully_shard got mesh "
            f"{dp_mesh}: both must be named, disjoint slices of one mesh, e.g. "
            "mesh = init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp')); TP on "
            "mesh['tp'], fully_shard(..., mesh=mesh['dp'])."
        )
    concat = getattr(DeviceMesh, "_concatenate", None)
    try:
        if concat is not None:
            joined: DeviceMesh = concat([dp_mesh, tp_mesh])
        else:  # older torch: slice the root mesh by name
            root = dp_mesh._get_root_mesh()
            joined = root[(*dp_names, *tp_names)]
    except Exception as exc:
        raise UsageError(
            f"fully_shard's mesh {dp_mesh} and the tensor-parallel mesh {tp_mesh} are not slices "
            f"of one mesh ({exc}). Slice both from the same init_device_mesh(...)."
        ) from exc
    return joined


def mesh_info(mesh: DeviceMesh, dp_mesh_dims: object = None) -> MeshInfo:
    """Validate ``mesh`` and describe its shard / replicate groups."""
    if not isinstance(mesh, DeviceMesh):
        raise ConfigTypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}. Build one with init_device_mesh(...)."
        )
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim not in (1, 2):
        raise ConfigError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh (shard) or a "
            f"2-D mesh (replicate, shard), got a {mesh.ndim}-D mesh {tuple(mesh.shape)}. Slice it to the "
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
    device = _device_of(mesh)
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


# One-rank groups, per mesh, for replicated parameters (local to each rank).
_SELF_GROUPS: weakref.WeakKeyDictionary[DeviceMesh, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def replicate_info(mesh: DeviceMesh) -> MeshInfo:
    """The layout of parameters replicated over the 1-D ``mesh`` (DDP-style:
    whole on every rank, gradients all-reduced over the mesh)."""
    if mesh.ndim != 1:
        raise UnsupportedError(
            f"Replicate() from shard_placement_fn needs a 1-D mesh, got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; pass ShardPlacementResult(Replicate(), DDPMeshInfo(mesh_1d, "
            "replicate_mesh_dim=0)) or shard that parameter."
        )
    own = _SELF_GROUPS.get(mesh)
    if own is None:
        own = _SELF_GROUPS[mesh] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return MeshInfo(mesh, own, 1, 0, mesh.get_group(0), mesh.size(0), _device_of(mesh), replicate_only=True)


def mesh_info_of(obj: object) -> MeshInfo:
    """Our layout for a mesh description in PyTorch's form (``FSDPMeshInfo``,
    ``HSDPMeshInfo`` or ``DDPMeshInfo`` of ``ShardPlacementResult.mesh_info``:
    ``mesh``, ``shard_mesh_dim``, ``replicate_mesh_dim``)."""
    mesh = getattr(obj, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise ConfigTypeError(
            f"a ShardPlacementResult's mesh_info must describe a DeviceMesh (mesh, shard_mesh_dim, "
            f"replicate_mesh_dim), got {type(obj).__name__}."
        )
    if getattr(obj, "dp_mesh_dims", None) is not None:
        raise UnsupportedError("per-parameter meshes with dp_mesh_dims are not supported; pass the data-parallel mesh.")
    shard, replicate = getattr(obj, "shard_mesh_dim", None), getattr(obj, "replicate_mesh_dim", None)
    names = mesh.mesh_dim_names or ()

    def sub(dims: tuple[int, ...]) -> DeviceMesh:
        if tuple(range(mesh.ndim)) == dims:
            return mesh
        if not names:
            raise ConfigError(f"mesh {mesh} needs mesh_dim_names to select dims {dims} of it.")
        return mesh[tuple(names[d] for d in dims)] if len(dims) > 1 else mesh[names[dims[0]]]

    if shard is None:
        if replicate is None:
            raise ConfigError("a mesh info needs a shard_mesh_dim, a replicate_mesh_dim, or both.")
        return replicate_info(sub((replicate,)))
    if replicate is None:
        return mesh_info(sub((shard,)))
    return mesh_info(sub((replicate, shard)))


# Subgroups are collective to create; cache them so that many modules asking for
# the same size share one set of process groups.
_SUBGROUPS: dict[tuple[tuple[int, ...], int], SubgroupInfo] = {}


def post_forward_subgroup(info: MeshInfo, size: int) -> SubgroupInfo:
    """The group of ``size`` consecutive shard-group ranks that this rank belongs to."""
    with unset_fake_temporarily():  # the mesh's rank table is real, also under the planner's fake tensors
        rows: list[list[int]] = info.mesh.mesh.reshape(-1, info.shard_size).tolist()
    key = (tuple(r for row in rows for r in row), size)
    cached = _SUBGROUPS.get(key)
    if cached is not None and cached.group in dist.distributed_c10d._world.pg_map:
        return cached  # (a group of a destroyed world, e.g. the planner's last fake one, is made anew)
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


_log = logging.getLogger("shardwise")


@functools.cache
def _log_once(message: str) -> None:
    """Log ``message`` once per process, as PyTorch's fully_shard logs its
    notes on arguments (a log record, not a Python warning)."""
    _log.warning(message)


def _factors(n: int) -> str:
    """``"1, 2, 4 or 8"``: the positive factors of ``n``."""
    found = [str(k) for k in range(1, n + 1) if n % k == 0]
    if len(found) > 12:
        return f"{', '.join(found[:6])}, ... or {found[-1]}"
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


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
            f"If passing reshard_after_forward as an int, it should be a factor of {info.shard_size}, "
            f"not {value}: reshard_after_forward={value} must be one of the shard group size's "
            f"factors ({_factors(info.shard_size)})."
        )
    if value == 1:
        _log_once(  # PyTorch's words first
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
            "reshard_after_forward=True (bool): every parameter stays whole after forward, as with "
            "reshard_after_forward=False, which is used."
        )
        return False
    if value == info.shard_size:
        return True
    return value
