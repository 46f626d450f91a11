"""Sharding strategy -> engine settings: the mesh and ``reshard_after_forward``.

[Note: strategy table]
Every strategy is the one engine with a different mesh and resharding:

=====================  ==========================  ======================  =============
strategy               mesh                        reshard_after_forward   no_sync keeps
=====================  ==========================  ======================  =============
FULL_SHARD             1-D over the group          None (all but root)     nothing
SHARD_GRAD_OP          1-D over the group          False                   full params
NO_SHARD               2-D (group, 1)              False                   nothing
HYBRID_SHARD           2-D (inter, intra)          None                    nothing
_HYBRID_SHARD_ZERO2    2-D (inter, intra)          False                   full params
=====================  ==========================  ======================  =============

NO_SHARD replicates over the whole group and "shards" over one rank, so the
engine's HSDP path all-reduces the gradients (like DDP) and the shards are
the whole parameters. "no_sync keeps full params": inside ``no_sync()`` the
gathered parameters also survive backward (``reshard_after_backward=False``),
as PyTorch does for the ZeRO-2 strategies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.errors import ConfigError, ConfigTypeError

from .config import ShardingStrategy

__all__ = ["HYBRID_STRATEGIES", "StrategyPlan", "resolve_strategy"]

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_KEEP_AFTER_FORWARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy.NO_SHARD)
_KEEP_IN_NO_SYNC = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class StrategyPlan:
    """What one strategy means for the engine."""

    strategy: ShardingStrategy
    mesh: DeviceMesh
    # None: free after forward except at the root; False: keep until backward ends.
    reshard_after_forward: bool | None
    # Inside no_sync(), keep the gathered parameters after backward too.
    keep_params_in_no_sync: bool
    # The group parameters are sharded over (PyTorch's ``process_group``).
    shard_group: dist.ProcessGroup
    # The group gradients are all-reduced over (HSDP, NO_SHARD), else None.
    replicate_group: dist.ProcessGroup | None
    # The mesh the user passed where ``mesh`` is another: an unnamed 2-D one
    # (``mesh`` names it "replicate", "shard"), or NO_SHARD's 1-D one (``mesh``
    # is (replicate, 1)); see ``MeshInfo.spec_mesh``.
    spec_mesh: DeviceMesh | None = None

    @property
    def is_sharded(self) -> bool:
        """Whether parameters are split across more than one rank."""
        return self.strategy != ShardingStrategy.NO_SHARD


# Process groups are collective to create: build each layout once per world.
_MESHES: dict[tuple[object, ...], DeviceMesh] = {}
_SINGLETONS: dict[tuple[int, int], dist.ProcessGroup] = {}


def _world_key() -> int:
    return id(dist.group.WORLD)


def default_device_type(device_id: torch.device | None) -> str:
    """The mesh device type: ``device_id``'s, else CUDA under NCCL, else CPU."""
    if device_id is not None:
        return device_id.type
    backend = str(dist.get_backend())
    if torch.cuda.is_available() and ("nccl" in backend or "cuda" in backend):
        return "cuda"
    return "cpu"


def _singleton_group() -> dist.ProcessGroup:
    key = (_world_key(), dist.get_rank())
    group = _SINGLETONS.get(key)
    if group is None:
        # Only this rank takes part, so no other rank needs to make the call.
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _SINGLETONS[key] = group
    return group


def _cached(key: tuple[object, ...], build: object) -> DeviceMesh:
    full = (_world_key(), *key)
    mesh = _MESHES.get(full)
    if mesh is None:
        mesh = build()  # type: ignore[operator]
        _MESHES[full] = mesh
    return mesh


def _check_group(value: object, arg: str) -> dist.ProcessGroup:
    if not isinstance(value, dist.ProcessGroup):
        raise ConfigTypeError(
            f"{arg} must be a torch.distributed.ProcessGroup, got {type(value).__name__}."
        )
    return value


def _replicated(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A (group, 1) mesh: replicate over ``group``, shard over this rank alone."""
    ranks = dist.get_process_group_ranks(group)

    def build() -> DeviceMesh:
        return DeviceMesh.from_group(
            [group, _singleton_group()],
            device_type,
            mesh=torch.tensor(ranks).reshape(len(ranks), 1),
            mesh_dim_names=("replicate", "shard"),
        )

    return _cached(("no_shard", id(group), device_type), build)


def _hybrid_from_groups(intra: dist.ProcessGroup, inter: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    def build() -> DeviceMesh:
        # Row i of the mesh is the intra-node group of the inter-group's rank i.
        rows: list[list[int] | None] = [None] * dist.get_world_size(inter)
        dist.all_gather_object(rows, dist.get_process_group_ranks(intra), group=inter)
        return DeviceMesh.from_group(
            [inter, intra], device_type, mesh=torch.tensor(rows), mesh_dim_names=("replicate", "shard")
        )

    return _cached(("hybrid", id(intra), id(inter), device_type), build)


def _devices_per_node(device_type: str) -> int:
    """As FSDP1: a node holds as many ranks as this host has devices of the
    type (one on CPU)."""
    try:
        return int(torch.get_device_module(device_type).device_count())
    except (AttributeError, RuntimeError):
        return 0


def _hybrid_default(strategy: ShardingStrategy, device_type: str) -> DeviceMesh:
    world = dist.get_world_size()
    per_node = _devices_per_node(device_type)
    if per_node <= 0 or world % per_node:
        why = f"no {device_type} devices" if per_node <= 0 else (
            f"{world} ranks are not a multiple of {per_node} devices per node"
        )
        raise ConfigError(
            f"sharding_strategy={strategy.name} needs to know which ranks form a node, and with "
            f"process_group=None and device_mesh=None on {device_type!r} it cannot ({why}). "
            "Pass device_mesh=init_device_mesh(device_type, (num_nodes, ranks_per_node)) or "
            "process_group=(intra_node_group, inter_node_group)."
        )
    return _cached(
        ("hybrid_default", device_type, per_node),
        lambda: init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard")),
    )


def _mesh_for(
    strategy: ShardingStrategy,
    process_group: object,
    device_mesh: DeviceMesh | None,
    device_type: str,
    auto_wrap: bool,
) -> DeviceMesh:
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise ConfigTypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}.")
        if process_group is not None:
            raise ConfigError(
                "pass either process_group or device_mesh, not both: the mesh already names its groups."
            )
        if hybrid:
            if device_mesh.ndim != 2:
                raise ConfigError(
                    f"sharding_strategy={strategy.name} needs a 2-D device_mesh (replicate, shard), got a "
                    f"{device_mesh.ndim}-D mesh {tuple(device_mesh.shape)}. Build it with "
                    "init_device_mesh(device_type, (num_nodes, ranks_per_node))."
                )
            if device_mesh.mesh_dim_names is None:
                # FSDP1 accepts an unnamed mesh; the engine (like fully_shard) wants names.
                return DeviceMesh.from_group(
                    [device_mesh.get_group(0), device_mesh.get_group(1)],
                    device_mesh.device_type,
                    mesh=device_mesh.mesh,
                    mesh_dim_names=("replicate", "shard"),
                )
            return device_mesh
        if device_mesh.ndim != 1:
            raise ConfigError(
                f"sharding_strategy={strategy.name} takes a 1-D device_mesh, got a {device_mesh.ndim}-D "
                f"mesh {tuple(device_mesh.shape)}; use sharding_strategy=HYBRID_SHARD for a 2-D mesh."
            )
        if strategy == ShardingStrategy.NO_SHARD:
            return _replicated(device_mesh.get_group(0), device_mesh.device_type)
        return device_mesh
    if hybrid:
        if process_group is None:
            if not auto_wrap:
                # FSDP1's words: wrappers made one by one could not be sure
                # to agree on the groups a default would make.
                raise ConfigError(
                    f"Manual wrapping with {strategy} requires explicit specification of process group "
                    "or device_mesh. Pass device_mesh=init_device_mesh(device_type, (num_nodes, "
                    "ranks_per_node)) or process_group=(intra_node_group, inter_node_group)."
                )
            return _hybrid_default(strategy, device_type)
        if not (isinstance(process_group, (tuple, list)) and len(process_group) == 2):
            raise ConfigError(
                "Expected process_group to be passed in as either None or Tuple[dist.ProcessGroup, "
                f"dist.ProcessGroup] but got {type(process_group)}: "
                f"sharding_strategy={strategy.name} with a process_group needs the pair "
                "(intra_node_group, inter_node_group), got "
                f"{type(process_group).__name__}. Pass process_group=(intra, inter) or "
                "device_mesh=init_device_mesh(device_type, (num_nodes, ranks_per_node))."
            )
        intra = _check_group(process_group[0], "process_group[0] (the intra-node group)")
        inter = _check_group(process_group[1], "process_group[1] (the inter-node group)")
        return _hybrid_from_groups(intra, inter, device_type)
    if isinstance(process_group, (tuple, list)):
        raise ConfigError(
            f"a (intra, inter) pair of process groups is only for HYBRID_SHARD / _HYBRID_SHARD_ZERO2, "
            f"not sharding_strategy={strategy.name}; pass one process group."
        )
    group = dist.group.WORLD if process_group is None else _check_group(process_group, "process_group")
    if strategy == ShardingStrategy.NO_SHARD:
        return _replicated(group, device_type)  # type: ignore[arg-type]
    if process_group is None:
        return _cached(("world", device_type), lambda: init_device_mesh(device_type, (dist.get_world_size(),)))
    return _cached(("group", id(group), device_type), lambda: DeviceMesh.from_group(group, device_type))  # type: ignore[arg-type]


def check_strategy(value: object) -> ShardingStrategy:
    """``None`` means ``FULL_SHARD``; anything but a :class:`ShardingStrategy` is refused."""
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    names = ", ".join(f"ShardingStrategy.{s.name}" for s in ShardingStrategy)
    raise ConfigTypeError(f"sharding_strategy must be one of {names} (or None), got {value!r}.")


def resolve_strategy(
    strategy: ShardingStrategy,
    process_group: object,
    device_mesh: DeviceMesh | None,
    device_type: str,
    auto_wrap: bool = False,
) -> StrategyPlan:
    """The engine settings for ``strategy`` over the given groups; see [Note: strategy table].
    ``auto_wrap``: an auto-wrap policy was given (the hybrid strategies may
    then find the node groups themselves, as FSDP1's)."""
    if not dist.is_initialized():
        raise ConfigError(
            "FullyShardedDataParallel needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first."
        )
    mesh = _mesh_for(strategy, process_group, device_mesh, device_type, auto_wrap)
    raf: bool | None = False if strategy in _KEEP_AFTER_FORWARD else None
    if mesh.ndim == 1:
        shard_group, replicate_group = mesh.get_group(0), None
    else:
        shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    spec_mesh = device_mesh if device_mesh is not None and mesh is not device_mesh and mesh.ndim == 2 else None
    return StrategyPlan(strategy, mesh, raf, strategy in _KEEP_IN_NO_SYNC, shard_group, replicate_group, spec_mesh)
