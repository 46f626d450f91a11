"""Setting the engine up on modules: the one way in for both fronts.

``fully_shard`` (which then swaps the module's class) and the wrapper's
constructor (which keeps the user's class and registers the module under
itself) both call :func:`shard_modules`: collect and validate the
parameters the call manages, build their sharded form and the group that
gathers and reduces them, move buffers to the compute device and attach the
hooks (``ModuleState``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.errors import ConfigError, ConfigTypeError, ShardDimError, UnsupportedError, UsageError
from shardwise.mesh import MeshInfo, mesh_info, mesh_info_of, replicate_info, resolve_reshard_after_forward
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .module_state import ModuleState, state_of
from .param_group import ParamGroup
from .settings import GroupSettings
from .sharded_param import GATHERED_FROM, ShardedParam

__all__ = ["shard_modules"]

# original parameter -> (description of the group that manages it, its name,
# its ShardedParam, its .grad when sharded): to refuse a parameter shared by
# two groups, and to give an optimizer that still holds it the sharded one.
_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# optimizer -> (sharding calls so far, how many parameters it held) when last
# checked: checked again after either changes (see _check_optimizer).
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_HOOKED: list[Any] = []
_SHARDINGS = [0]


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before an optimizer's step (again only when its parameter count
    changes): a parameter it holds that sharding replaced, or a temporary
    gathered one (captured inside summon_full_params, or after a forward that
    left a group gathered), is swapped for the sharded parameter the model
    trains; otherwise its step would silently update a tensor the model no
    longer uses. A replaced parameter that already has optimizer state cannot
    be swapped (its state is whole, the parameter a shard): refused."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == (_SHARDINGS[0], count):  # type: ignore[no-untyped-call]
        return
    settled = True
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for group in optimizer.param_groups:
        params = group["params"]
        for i in reversed(range(len(params))):
            p = params[i]
            owned = _OWNED.get(p)  # type: ignore[no-untyped-call]
            sp: ShardedParam | None = owned[2]() if owned is not None else getattr(p, GATHERED_FROM, None)
            # A DTensor whose layout needed no change is kept as the sharded
            # parameter: registered in _OWNED (shared-parameter checks need it),
            # yet nothing to swap.
            if sp is None or sp.sharded_param is p:
                continue
            if owned is not None and p.grad is not None and (owned[3] is None or owned[3]() is not p.grad):
                # A gradient reached the original since sharding: the model still
                # computes with it elsewhere (a module outside every group holds it,
                # e.g. a tied head when only the embedding was sharded), so it
                # trains as it is, apart from the sharded copy, as in PyTorch.
                continue
            if owned is None and any(m._parameters.get(n) is p for m, n in sp.owners):
                settled = False  # still registered (inside summon_full_params): a step now is legitimate
                continue
            if optimizer.state.get(p):
                what = f"parameter {owned[1]!r} of {owned[0]} as it was before sharding" if owned else (
                    f"the temporary gathered parameter of {sp.fqn}")
                raise UsageError(
                    f"{type(optimizer).__name__} holds {what} (shape {tuple(p.shape)}) with optimizer state, "
                    "which cannot follow it to its sharded parameter (the state is whole, the parameter a "
                    "shard), and the model trains only the sharded one. Build the optimizer after "
                    f"fully_shard / FullyShardedDataParallel, from model.parameters() outside forward "
                    f"and summon_full_params: {type(optimizer).__name__}(model.parameters(), ...)."
                )
            replacement = sp.sharded_param
            if id(replacement) in held:
                del params[i]
            else:
                params[i] = replacement
                held.add(id(replacement))
    if settled:
        _CHECKED[optimizer] = (_SHARDINGS[0], sum(len(g["params"]) for g in optimizer.param_groups))


def shard_modules(
    modules: tuple[nn.Module, ...],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: Any,
    dp_mesh_dims: Any = None,
    spec_mesh: DeviceMesh | None = None,
) -> ModuleState:
    """Shard the parameters of ``modules`` (one ``fully_shard`` call) that no
    nested call owns; return the state whose hooks drive them. Arguments are
    ``fully_shard``'s, their types already checked; ``reshard_after_forward``
    None is the automatic choice (True, except for the root). ``spec_mesh``:
    see ``MeshInfo.spec_mesh`` (the wrapper API's)."""
    info = mesh_info(mesh, dp_mesh_dims)
    if spec_mesh is not None:
        info = dataclasses.replace(info, spec_mesh=spec_mesh)
    auto = reshard_after_forward is None
    if info.spmd_mesh is not None and isinstance(reshard_after_forward, int) and not isinstance(
        reshard_after_forward, bool
    ):
        raise UnsupportedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims); "
            "pass True or False."
        )
    raf = resolve_reshard_after_forward(True if reshard_after_forward is None else reshard_after_forward, info)
    ignored = _check_ignored(ignored_params, modules)
    conflicts: list[Conflict] = []
    collected = _collect_params(modules, ignored, conflicts, None if info.spmd_mesh is not None else info.mesh)
    # Trainable dtypes are checked at the first forward, as PyTorch does
    # (requires_grad may still change until then).
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    storage_device = torch.device("cpu") if offload else info.device
    planned = _make_sharded_params(collected, info, shard_placement_fn, storage_device)
    _move_buffers(modules, info.device)

    groups: list[ParamGroup] = []
    desc = f"{type(modules[0]).__name__}"
    # Pinned host shards let the host-to-device copy overlap compute (CUDA only).
    pin = offload and offload_policy.pin_memory and torch.cuda.is_available()  # type: ignore[attr-defined]
    for g_info, params, sources in planned:
        g_raf = raf
        if g_info is not info:  # another mesh: reshard_after_forward=<int> is checked against it
            g_raf = bool(raf) if g_info.replicate_only else resolve_reshard_after_forward(raf, g_info)
        settings = GroupSettings(mp=mp_policy)
        groups.append(ParamGroup(params, sources, g_info, info.device, settings, g_raf, storage_device, desc, pin))
    del planned  # never keep the full tensors alive
    by_name = {sp.fqn: sp for g in groups for sp in g.params}
    for orig, _, fqn in collected:
        grad = None if orig.grad is None else weakref.ref(orig.grad)
        _OWNED[orig] = (desc, fqn, weakref.ref(by_name[fqn]), grad)  # weak: the original may live on in the engine
    _SHARDINGS[0] += 1
    if not _HOOKED:
        _HOOKED.append(register_optimizer_step_pre_hook(_check_optimizer))
    for managed in _managed_modules(modules):
        # What PyTorch sets on every module it manages (dynamo and tools read them).
        managed._is_fsdp_managed_module = True  # type: ignore[assignment]
        managed._fsdp_use_orig_params = True  # type: ignore[assignment]
    state = ModuleState(modules, groups, mp_policy, auto, info.device)
    # In this call's order, as PyTorch's group holds them: each parameter (by
    # the engine's parameter that manages it, a conflict's by its owner's) and
    # its first place; read only to report a conflict at the first forward.
    claims: list[tuple[object, nn.Module, str]] = [(by_name[fqn], *places[0]) for _, places, fqn in collected]
    for c in reversed(conflicts):
        claims.insert(c.before, (c.owner, c.module, c.attr))
    state.shared_claims = claims
    if conflicts:
        state.conflict = f"{conflicts[0].fqn!r} is also managed by the fully_shard of {conflicts[0].owner_name}"
    return state


def replicated(mod: nn.Module) -> bool:
    """Whether PyTorch's composable ``replicate()`` (DDP) manages ``mod``.
    PyTorch's fully_shard leaves such a module, and all under it, to DDP; so
    do we. replicate() records itself in the composable-API registry in the
    module's ``__dict__``, under a per-process key with a fixed prefix, by
    its function's name: read there, without importing PyTorch's
    composable-API package."""
    return any(
        key.startswith("__composable_api_state_key") and isinstance(value, dict) and "replicate" in value
        for key, value in vars(mod).items()
    )


def _managed_modules(modules: tuple[nn.Module, ...]) -> list[nn.Module]:
    """``modules`` and their submodules not under a nested fully_shard or a
    ``replicate()``."""
    out: list[nn.Module] = []
    stack = [m for m in modules if not replicated(m)]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(c for c in m.children() if state_of(c) is None and not replicated(c))
    return out


def _check_ignored(ignored_params: Any, modules: tuple[nn.Module, ...]) -> set[int]:
    if ignored_params is None:
        return set()
    try:
        items = list(ignored_params)
    except TypeError:
        raise ConfigTypeError(
            f"ignored_params must be a set of nn.Parameters, got {type(ignored_params).__name__}."
        ) from None
    for p in items:
        if not isinstance(p, torch.Tensor):
            raise ConfigTypeError(f"ignored_params must hold nn.Parameters, got {type(p).__name__}.")
    # A Parameter of another module is allowed (PyTorch's fully_shard takes one
    # set for a whole model, and the wrapper passes its root's to every unit);
    # a tensor that is no parameter anywhere would be ignored silently.
    plain = [p for p in items if not isinstance(p, nn.Parameter)]
    if plain:
        registered = {id(t) for m in modules for sub in m.modules() for t in sub._parameters.values()}
        for p in plain:
            if id(p) not in registered:
                raise ConfigError(
                    f"ignored_params holds a tensor of shape {tuple(p.shape)} ({p.dtype}) that is not a "
                    "parameter of the module: a plain tensor (param.data, param.detach(), a state_dict() "
                    "value, a copy) never matches a parameter, so that parameter would be sharded anyway. "
                    "Pass the nn.Parameter objects the module registers, e.g. "
                    "ignored_params=set(module.head.parameters())."
                )
    return {id(p) for p in items}


Collected = tuple[nn.Parameter, list[tuple[nn.Module, str]], str]


def _on_data_parallel_mesh(p: DTensor, dp_mesh: DeviceMesh | None) -> bool:
    """Whether a DTensor parameter already uses the data-parallel mesh (sharded
    by fully_shard applied top-down) rather than a tensor-parallel one. With
    ``dp_mesh_dims`` (``dp_mesh`` None) parameters live on the whole mesh."""
    if dp_mesh is None:
        return False
    mesh = p.device_mesh
    if mesh == dp_mesh:
        return True
    names, dp_names = mesh.mesh_dim_names, dp_mesh.mesh_dim_names
    return names is None or dp_names is None or bool(set(names) & set(dp_names))


class Conflict(NamedTuple):
    """A parameter another fully_shard already manages, met by this call."""

    before: int  # how many of this call's own parameters come before it
    owner: object  # the owner's engine parameter (what identifies it)
    module: nn.Module  # its first place here: module and attribute
    attr: str
    fqn: str  # its name under this call's module
    owner_name: str


def _collect_params(
    modules: tuple[nn.Module, ...], ignored: set[int], conflicts: list[Conflict], dp_mesh: DeviceMesh | None = None
) -> list[Collected]:
    """Parameters of ``modules`` not owned by a nested fully_shard, with every
    place each is registered; validated before anything is changed. Parameters
    that another group already manages go into ``conflicts``."""
    found: dict[int, Collected] = {}
    conflicting: set[int] = set()
    conflict_ids: list[int] = []
    seen_modules: set[int] = set()
    # The group's order, PyTorch's: modules in post-order (children before
    # their parent), each module's own parameters in order, the first place
    # counting. Places and names are found in pre-order (named_parameters').
    order: dict[int, int] = {}

    def visit(mod: nn.Module, prefix: str, top: bool) -> None:
        if id(mod) in seen_modules:
            return
        seen_modules.add(id(mod))
        if not top and state_of(mod) is not None:
            return  # owned by a nested fully_shard
        if replicated(mod):
            return  # DDP's (PyTorch's fully_shard skips it too)
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            if id(p) in found:
                found[id(p)][1].append((mod, name))
                continue
            if isinstance(p, DTensor) and _on_data_parallel_mesh(p, dp_mesh):
                # RuntimeError too, as PyTorch raises ("Cannot concatenate overlapping meshes")
                raise UsageError(
                    f"parameter {fqn!r} is already a DTensor on {p.device_mesh} "
                    f"{tuple(p.placements)}, which shares mesh dims with fully_shard's mesh "
                    f"{dp_mesh}. If it is already sharded: apply fully_shard bottom-up (inner "
                    "modules first, then their parents), once per module. If it is tensor "
                    "parallel: pass fully_shard only the data-parallel dims of the same mesh "
                    "(TP on mesh['tp'] -> mesh=mesh['dp']), or the whole mesh with dp_mesh_dims."
                )
            owner = _OWNED.get(p)  # type: ignore[no-untyped-call]
            if owner is not None:
                # Left unmanaged here; reported at the first forward, as PyTorch does
                # (its first place among this call's parameters decides which name is reported).
                if id(p) not in conflicting:
                    conflicting.add(id(p))
                    conflict_ids.append(id(p))
                    conflicts.append(Conflict(0, owner[2]() or p, mod, name, fqn, owner[0]))
                continue
            if p.ndim == 0:
                raise ConfigError(
                    f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor "
                    "with numel equal to 1."
                )
            found[id(p)] = (p, [(mod, name)], fqn)
        for cname, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", False)
        for p in mod._parameters.values():
            if p is not None and id(p) not in order and (id(p) in found or id(p) in conflicting):
                order[id(p)] = len(order)

    for i, m in enumerate(modules):
        visit(m, f"[{i}]." if len(modules) > 1 else "", True)
    collected = sorted(found.values(), key=lambda c: order[id(c[0])])
    # A conflict's place among this call's own parameters, in the same order.
    ranked = sorted(zip(conflict_ids, conflicts), key=lambda ic: order[ic[0]])
    conflicts[:] = [
        c._replace(before=sum(order[id(q)] < order[i] for q, _, _ in collected)) for i, c in ranked
    ]
    devices = {p.device for p, _, _ in collected}
    if len(devices) > 1:
        where = ", ".join(f"{fqn} on {p.device}" for p, _, fqn in collected[:6])
        raise ConfigError(
            f"fully_shard needs all of a module's parameters on one device, found {sorted(map(str, devices))} "
            f"({where}, ...). Move the module first, e.g. module.to(device), or build it on the meta device."
        )
    return collected


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    """Buffers are never sharded; like parameters they go to the compute device."""
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.device.type != "meta" and buf.device != device:
                    sub._buffers[name] = buf.to(device)


def _placement(
    p: nn.Parameter, fqn: str, info: MeshInfo, fn: Callable[[nn.Parameter], Any] | None, infos: dict[int, MeshInfo]
) -> tuple[MeshInfo, int]:
    """Where ``p`` goes: its mesh layout and shard dim, from ``shard_placement_fn``'s
    answer: None (``Shard(0)`` on ``mesh``), ``Shard(dim)``, ``Replicate()``
    (whole on every rank of the 1-D ``mesh``, gradients all-reduced), or an
    object with ``placement`` and ``mesh_info`` (PyTorch's
    ``ShardPlacementResult``: another mesh for this parameter, e.g. experts).
    ``infos`` caches the layout of each mesh-info object seen."""
    result = fn(p) if fn is not None else None
    placement: Any = result
    if result is not None and hasattr(result, "placement") and hasattr(result, "mesh_info"):
        placement = result.placement
        key = id(result.mesh_info)
        if key not in infos:
            infos[key] = mesh_info_of(result.mesh_info)
        info = infos[key]
        if info.replicate_only and placement is None:
            placement = Replicate()
    if placement is None:
        return info, 0
    if isinstance(placement, Replicate):
        if not info.replicate_only:
            if info.spmd_mesh is not None or info.mesh.ndim != 1:
                raise UnsupportedError(
                    f"shard_placement_fn returned Replicate() for {fqn}: supported on a 1-D mesh "
                    f"only, and fully_shard's mesh is {tuple(info.mesh.shape)}."
                )
            key = id(info.mesh)
            if key not in infos:
                infos[key] = replicate_info(info.mesh)
            info = infos[key]
        return info, 0
    if not isinstance(placement, Shard):
        raise ConfigTypeError(
            f"shard_placement_fn must return Shard(dim), Replicate(), a ShardPlacementResult or None, "
            f"got {placement!r} for {fqn}."
        )
    if info.replicate_only:
        raise ConfigError(
            f"shard_placement_fn gave {fqn} {placement} on a mesh that only replicates "
            "(replicate_mesh_dim without shard_mesh_dim); give it Replicate() or a shard mesh dim."
        )
    dim = placement.dim if placement.dim >= 0 else placement.dim + p.ndim
    if not 0 <= dim < p.ndim:
        raise ShardDimError(
            f"Shard dim {placement.dim} is invalid for {p.ndim}D tensor: shard_placement_fn returned "
            f"Shard({placement.dim}) for {fqn} of shape "
            f"{tuple(p.shape)}; the dim must be in [-{p.ndim}, {p.ndim})."
        )
    local_shape = (p._local_tensor if isinstance(p, DTensor) else p).shape
    if dim != 0 and local_shape[dim] % info.shard_size != 0:
        raise UnsupportedError(
            f"FSDP does not support uneven sharding on dim {dim}: {fqn} has shape "
            f"{tuple(p.shape)} and the shard group has {info.shard_size} ranks (as in "
            "PyTorch). Shard it on dim 0, or on a dim its size divides evenly."
        )
    return info, dim


def _make_sharded_params(
    collected: list[Collected],
    info: MeshInfo,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    storage_device: torch.device,
) -> list[tuple[MeshInfo, list[ShardedParam], list[torch.Tensor]]]:
    """One ``ShardedParam`` per collected parameter (its placement validated),
    grouped by the collectives its mesh layout uses (in order of appearance,
    as PyTorch orders its parameter groups), each with the tensors the shards
    are first copied from."""
    infos: dict[int, MeshInfo] = {}
    groups: dict[tuple[int, int], tuple[MeshInfo, list[ShardedParam], list[torch.Tensor]]] = {}
    for p, owners, fqn in collected:
        p_info, dim = _placement(p, fqn, info, shard_placement_fn, infos)
        entry = groups.setdefault(p_info.key, (p_info, [], []))
        entry[1].append(ShardedParam(p, owners, p_info, dim, fqn))
        # This rank's first source: the TP-local tensor for DTensors.
        src = p._local_tensor if isinstance(p, DTensor) else p
        if src.device.type != "meta" and src.device != storage_device:
            src = src.detach().to(storage_device)
        entry[2].append(src)
    return list(groups.values())
