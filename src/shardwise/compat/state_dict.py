"""Model state dicts for the wrapper API: the three ``StateDictType`` s, with
the original parameter names.

[Note: state-dict hooks]
Each wrapper registers a post-save hook and a pre-load hook on itself, as
PyTorch's wrapper does, so ``state_dict()`` / ``load_state_dict()`` work from
any module above it. Saving runs bottom-up: a wrapper's hook sees the keys of
its subtree (nested wrappers already done), drops its own
``_fsdp_wrapped_module.`` segment from every one of them and converts the
values of the tensors it owns itself. Loading runs top-down: a wrapper's hook
puts its segment back into every key of its subtree and converts the values
it owns into what its parameters are (sharded ``DTensor`` s).

======================  ===========================  ==============================
type                    saved parameter value        loaded from
======================  ===========================  ==============================
FULL_STATE_DICT         whole tensor (gathered)      whole tensor: this rank's chunk
LOCAL_STATE_DICT        this rank's shard (Tensor)   the same rank's shard
SHARDED_STATE_DICT      the sharded DTensor          a DTensor of the same sharding
======================  ===========================  ==============================

A ``NO_SHARD`` wrapper saves and loads its own tensors as under
FULL_STATE_DICT (default config) whatever the type says, with FSDP1's
warning, as FSDP1 does.

Buffers are not sharded; full and sharded dicts hold them in their original
dtype (before ``MixedPrecision.buffer_dtype``), local ones as they are. To
load a sharded dict saved under another world size, read it with
``torch.distributed.checkpoint.load`` into this model's own sharded state dict.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from shardwise._engine.param_group import ParamGroup
from shardwise._engine.sharded_param import ShardedParam
from shardwise.checkpoint.state import register_sharded_state_dict
from shardwise.errors import ConfigError, ConfigTypeError, InconsistentSettingsError, MismatchError, UsageError
from shardwise.layout import chunk_span, dtensor_like

from .config import (
    CONFIG_FOR_TYPE,
    FullStateDictConfig,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    from_pytorch,
)
from .managed import CHECKPOINT_WRAPPED, WRAPPED_MODULE, Ignored, OwnTensor, is_wrapper, own_tensors
from .strategies import StrategyPlan



class WrapperState(Protocol):
    """What this module reads and sets on a ``FullyShardedDataParallel``,
    typed structurally: the wrapper imports this module, never the reverse."""

    _fsdp_wrapped_module: nn.Module
    _fsdp_unit: nn.Module
    _ignored: Ignored
    _buffer_dtypes: dict[str, torch.dtype]
    _state_dict_settings: StateDictSettings
    _plan: StrategyPlan
    _device_mesh: DeviceMesh | None

    @property
    def _group(self) -> ParamGroup | None: ...

__all__ = [
    "check_local_without_mesh",
    "chunk_of_whole",
    "clean_fqn",
    "clean_name",
    "get_state_dict_type",
    "local_chunk",
    "register_state_dict_hooks",
    "root_wrappers",
    "set_state_dict_type",
    "sharded_params",
    "whole",
    "wrappers_under",
]

_SEGMENT = WRAPPED_MODULE + "."
# Models whose sharded state dicts ``shardwise.checkpoint`` is reading: their
# values are the shards themselves, not copies (see _save_value).
_SHARE_SHARDS: list[nn.Module] = []
# wrapper -> the error list of the load in progress (see _post_load_hook).
_LOAD_ERRORS: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()


def clean_name(name: str) -> str:
    """``name`` without any ``_fsdp_wrapped_module`` segment."""
    name = name.replace(_SEGMENT, "")
    if name == WRAPPED_MODULE:
        return ""
    if name.endswith("." + WRAPPED_MODULE):
        return name[: -len(WRAPPED_MODULE) - 1]
    return name


def clean_fqn(name: str) -> str:
    """``name`` as state dicts and optimizer state dicts key it: without the
    wrapper's and activation checkpointing's segments (PyTorch's ``clean_tensor_name``)."""
    return clean_name(name).replace(CHECKPOINT_WRAPPED + ".", "")


def _own_by_key(wrapper: WrapperState) -> dict[str, OwnTensor]:
    """The wrapper's own tensors under their state-dict keys (relative to it)."""
    return {clean_fqn(t.name): t for t in own_tensors(wrapper._fsdp_unit, wrapper._ignored)}


def wrappers_under(module: nn.Module) -> list[WrapperState]:
    """Every wrapper in ``module``'s subtree (``module`` included), in module order."""
    return [cast(WrapperState, m) for m in module.modules() if is_wrapper(m)]


def root_wrappers(module: nn.Module) -> list[WrapperState]:
    """The outermost wrappers in ``module``'s subtree (none nested in another)."""
    wrappers = wrappers_under(module)
    nested = {id(m) for w in wrappers for m in cast(nn.Module, w).modules() if id(m) != id(w) and is_wrapper(m)}
    return [w for w in wrappers if id(w) not in nested]


# ---- settings ---------------------------------------------------------------------
def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state-dict type and configs of every wrapper under ``module``;
    return the previous settings."""
    state_dict_type = from_pytorch(state_dict_type)  # PyTorch's own are taken as ours
    state_dict_config = from_pytorch(state_dict_config)
    optim_state_dict_config = from_pytorch(optim_state_dict_config)
    if not isinstance(state_dict_type, StateDictType):
        raise ConfigTypeError(
            f"state_dict_type must be a StateDictType (FULL_STATE_DICT, LOCAL_STATE_DICT or "
            f"SHARDED_STATE_DICT), got {state_dict_type!r}."
        )
    cfg_cls, optim_cls = CONFIG_FOR_TYPE[state_dict_type]
    cfg = cfg_cls() if state_dict_config is None else state_dict_config
    optim_cfg = optim_cls() if optim_state_dict_config is None else optim_state_dict_config
    if type(cfg) is not cfg_cls:
        raise MismatchError(  # FSDP1's words first (its tests match them)
            f"Expected state_dict_config of type {cfg_cls} but got {type(cfg)}: state_dict_config for "
            f"{state_dict_type.name} must be a {cfg_cls.__name__}; pass {cfg_cls.__name__}(...) or None."
        )
    if type(optim_cfg) is not optim_cls:
        raise MismatchError(
            f"Expected optim_state_dict_config of type {optim_cls} but got {type(optim_cfg)}: "
            f"optim_state_dict_config for {state_dict_type.name} must be a {optim_cls.__name__}; pass "
            f"{optim_cls.__name__}(...) or None."
        )
    wrappers = wrappers_under(module)
    if not wrappers:  # as PyTorch's: nothing to set, no previous settings
        return StateDictSettings(None, None, None)  # type: ignore[arg-type]
    previous = wrappers[0]._state_dict_settings
    for w in wrappers:
        w._state_dict_settings = StateDictSettings(state_dict_type, cfg, optim_cfg)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
    """The settings shared by every wrapper under ``module``; as PyTorch's,
    None where there is no wrapper."""
    return settings_of(module) if wrappers_under(module) else None


def settings_of(module: nn.Module, caller: str = "get_state_dict_type") -> StateDictSettings:
    """The settings shared by every wrapper under ``module`` (there must be one)."""
    wrappers = wrappers_under(module)
    if not wrappers:
        raise ConfigError(
            f"{caller}: {type(module).__name__} contains no FullyShardedDataParallel module; wrap the "
            "model first."
        )
    settings = wrappers[0]._state_dict_settings
    for w in wrappers[1:]:
        if w._state_dict_settings != settings:
            raise InconsistentSettingsError(
                "All FSDP modules must have the same state dict settings: "
                f"wrappers under {type(module).__name__} have different state-dict settings "
                f"({settings} vs {w._state_dict_settings}); set them together with "
                "FullyShardedDataParallel.set_state_dict_type(root_module, ...)."
            )
    return settings


@contextlib.contextmanager
def sharded_for_checkpoints(module: nn.Module) -> Iterator[None]:
    """``SHARDED_STATE_DICT`` for every wrapper under ``module`` for the
    duration (nothing if there is none): what ``shardwise.checkpoint`` reads
    and loads, so that a checkpoint of the wrapper API holds each rank's
    shards only, as one of ``fully_shard`` does (registered with
    ``shardwise.checkpoint.state.register_sharded_state_dict``)."""
    if not wrappers_under(module):
        yield
        return
    prev = settings_of(module)
    set_state_dict_type(module, StateDictType.SHARDED_STATE_DICT)
    _SHARE_SHARDS.append(module)  # the checkpoint writes them before training goes on: no copy
    try:
        yield
    finally:
        _SHARE_SHARDS.pop()
        set_state_dict_type(module, prev.state_dict_type, prev.state_dict_config, prev.optim_state_dict_config)


register_sharded_state_dict(sharded_for_checkpoints)


# ---- tensors ---------------------------------------------------------------------
def local_chunk(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements`` (``torch.chunk``
    semantics per sharded mesh dimension, empty past the last chunk); a view."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"rank {dist.get_rank()} is not part of mesh {mesh}.")
    out = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            n, r = mesh.size(mesh_dim), coordinate[mesh_dim]
            start, length = chunk_span(out.size(placement.dim), n, r)
            out = out.narrow(placement.dim, start, length)
    return out


def sharded_params(module: nn.Module) -> dict[int, ShardedParam]:
    """The wrappers' sharded parameters under ``module``, by the id of their
    ``DTensor`` (what ``named_parameters()`` and optimizers hold)."""
    return {id(sp.sharded_param): sp for w in wrappers_under(module) if w._group is not None for sp in w._group.params}


def _own_params(wrapper: WrapperState) -> dict[int, ShardedParam]:
    group = wrapper._group
    return {} if group is None else {id(sp.sharded_param): sp for sp in group.params}


def whole(value: DTensor, sp: ShardedParam | None) -> torch.Tensor:
    """A wrapper's sharded ``value`` (a parameter, its gradient, an optimizer
    state) made whole, as FSDP1 shows it: gathered over the shard group
    only, so a tensor-parallel parameter's is the TP-sharded DTensor its
    module held before wrapping; any other a plain tensor. A collective."""
    if sp is None or sp.tp_spec is None:
        return value.full_tensor()
    return sp.as_unwrapped(sp.gather_chunks(value.to_local()))


def chunk_of_whole(value: torch.Tensor, target: DTensor, sp: ShardedParam | None) -> torch.Tensor:
    """This rank's piece of ``value``, a whole tensor for ``target`` (what
    :func:`whole` gives, or a plain tensor of the global shape), as
    ``target``'s local tensor holds it; a view where it can be."""
    if sp is None or sp.tp_spec is None:
        return local_chunk(value, target.device_mesh, target.placements)
    spec = sp.tp_spec
    if isinstance(value, DTensor):
        if value.device_mesh == target.device_mesh and tuple(value.placements) == tuple(target.placements):
            return value.to_local()  # laid out as the parameter already (DCP's set_state_dict does this)
        if tuple(value.placements) != tuple(spec.placements):
            value = value.redistribute(spec.mesh, spec.placements)
        tp_local = value.to_local()
    else:  # a whole tensor: TP's cut first, then FSDP's
        tp_local = local_chunk(value, spec.mesh, spec.placements)
    return sp.layout.local_chunk(tp_local)


def _like(target: DTensor, local: torch.Tensor) -> DTensor:
    return dtensor_like(target, local.to(target.to_local().device))


def _is_mesh_rank0(wrapper: WrapperState) -> bool:
    coordinate = wrapper._plan.mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c in coordinate)


def _current(t: OwnTensor) -> torch.Tensor | None:
    return (t.module._parameters if t.is_param else t.module._buffers)[t.attr]


# ---- saving ----------------------------------------------------------------------
def _save_value(
    kind: StateDictType,
    cfg: StateDictConfig,
    value: torch.Tensor,
    orig_dtype: torch.dtype | None,
    sp: ShardedParam | None = None,
) -> torch.Tensor:
    # As FSDP1: full and sharded values are copies (changing the parameters
    # afterwards changes no saved value), local ones this rank's shard itself.
    if isinstance(value, DTensor):
        local = value.to_local()
        if kind == StateDictType.FULL_STATE_DICT:
            value = whole(value, sp)
            if not isinstance(value, DTensor) and value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                value = value.clone()  # one rank's "gather" (NO_SHARD) returns the shard itself
        elif kind == StateDictType.LOCAL_STATE_DICT:
            value = local
        else:
            if cfg.offload_to_cpu and local.device.type != "cpu":
                return dtensor_like(value, local.cpu())
            return value if _SHARE_SHARDS else dtensor_like(value, local.clone())
    if orig_dtype is not None and kind != StateDictType.LOCAL_STATE_DICT and value.dtype != orig_dtype:
        value = value.to(orig_dtype)
    if cfg.offload_to_cpu:
        value = value.cpu()
    return value


def warn_cpu_copies_on_every_rank() -> None:
    """FSDP1's warning (its words) where full parameters are copied to the CPU
    on every rank: ``offload_to_cpu=True`` without ``rank0_only``."""
    warnings.warn(
        "offload_to_cpu=True and rank0_only=False may result in the"
        "unsharded parameters being redundantly copied to CPU memory for "
        "GPUs sharing the same CPU memory, which risks CPU OOM. We "
        "recommend using offload_to_cpu=True with rank0_only=True.",
        stacklevel=3,
    )


def check_local_without_mesh(wrapper: WrapperState, kind: StateDictType) -> None:
    """FSDP1 refuses local state dicts (model and optimizer) of a wrapper
    built with a ``device_mesh``: its shards are DTensors; its words."""
    if kind == StateDictType.LOCAL_STATE_DICT and getattr(wrapper, "_device_mesh", None) is not None:
        raise UsageError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
            "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
        )


def _kind_and_config(wrapper: WrapperState, loading: bool = False) -> tuple[StateDictType, StateDictConfig]:
    """The state-dict type and config this wrapper's own tensors go by: a
    ``NO_SHARD`` wrapper's are whole on every rank, so FSDP1 saves and loads
    them as a full state dict (warning, before and after each) whatever the
    type says. Any other wrapper given a ``device_mesh`` refuses local ones,
    as FSDP1's."""
    if wrapper._plan.strategy == ShardingStrategy.NO_SHARD:
        warnings.warn(  # FSDP1's words (its load hooks lack a space)
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"
            + ("" if loading else " ") + "be returned.",
            stacklevel=4,
        )
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    settings = wrapper._state_dict_settings
    check_local_without_mesh(wrapper, settings.state_dict_type)
    return settings.state_dict_type, settings.state_dict_config


def _pre_save_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _kind_and_config(cast(WrapperState, module))  # only for NO_SHARD's warning


def _post_save_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    wrapper = cast(WrapperState, module)
    kind, cfg = _kind_and_config(wrapper)
    if (
        kind == StateDictType.FULL_STATE_DICT
        and cfg.offload_to_cpu
        and not getattr(cfg, "rank0_only", False)
        and wrapper._group is not None
    ):
        warn_cpu_copies_on_every_rank()  # once per wrapper with parameters, as FSDP1
    inner_prefix = prefix + _SEGMENT
    own = _own_by_key(wrapper)
    drop = (
        kind == StateDictType.FULL_STATE_DICT
        and getattr(cfg, "rank0_only", False)
        and not _is_mesh_rank0(wrapper)
    )
    keys = [k for k in state_dict if k.startswith(inner_prefix)]
    params = _own_params(wrapper) if kind == StateDictType.FULL_STATE_DICT else {}
    # A tied parameter has several names; gather it once.
    converted: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key in keys:
            value = state_dict.pop(key)
            rest = key[len(inner_prefix) :]
            t = own.get(clean_fqn(rest))
            if t is not None and isinstance(value, torch.Tensor):
                source = id(_current(t))
                if source not in converted:
                    # Buffers get their original dtype back only from a wrapper with
                    # parameters of its own, as FSDP1's hook returns early without.
                    orig = None if t.is_param or wrapper._group is None else wrapper._buffer_dtypes.get(clean_fqn(rest))
                    converted[source] = _save_value(kind, cfg, value, orig, params.get(source))
                value = converted[source]
            if not drop:
                state_dict[prefix + rest] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == prefix + WRAPPED_MODULE or k.startswith(inner_prefix)]:
            entry = metadata.pop(key)
            metadata[prefix[:-1] if key == prefix + WRAPPED_MODULE else prefix + key[len(inner_prefix) :]] = entry


# ---- loading ---------------------------------------------------------------------
def _load_value(
    kind: StateDictType, key: str, value: Any, target: torch.Tensor | None, sp: ShardedParam | None = None
) -> Any:
    if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if kind == StateDictType.FULL_STATE_DICT:
        tp = sp is not None and sp.tp_spec is not None
        if (isinstance(value, DTensor) and not tp) or value.shape != target.shape:
            return value  # a DTensor loads as is; a wrong shape is reported by load_state_dict
        return _like(target, chunk_of_whole(value, target, sp))
    if kind == StateDictType.LOCAL_STATE_DICT:
        local = target.to_local()
        if isinstance(value, DTensor) or value.shape != local.shape:
            got = f"a DTensor of shape {tuple(value.shape)}" if isinstance(value, DTensor) else f"shape {tuple(value.shape)}"
            raise ConfigError(
                f"LOCAL_STATE_DICT value {key!r} has {got}, but this rank's shard of it has shape "
                f"{tuple(local.shape)}: a local state dict loads only into the same sharding (world "
                "size, strategy, mesh). Save with SHARDED_STATE_DICT or FULL_STATE_DICT to load elsewhere."
            )
        return _like(target, value)
    if not isinstance(value, DTensor):
        raise ConfigError(
            f"SHARDED_STATE_DICT expects sharded DTensor values, but {key!r} is a plain tensor of shape "
            f"{tuple(value.shape)} (a full or local state dict). Load a full state dict under "
            "FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT), or save "
            "the checkpoint with SHARDED_STATE_DICT."
        )
    if value.device_mesh != target.device_mesh or tuple(value.placements) != tuple(target.placements) or value.shape != target.shape:
        raise ConfigError(
            f"SHARDED_STATE_DICT value {key!r} is sharded as {value.placements} on {value.device_mesh} "
            f"with shape {tuple(value.shape)}, but the parameter is {target.placements} on "
            f"{target.device_mesh} with shape {tuple(target.shape)}. To reshard, load the checkpoint "
            "with torch.distributed.checkpoint.load(model.state_dict(), ...) under SHARDED_STATE_DICT."
        )
    if value.to_local().device != target.to_local().device:
        return _like(target, value.to_local())
    return value


def _pre_load_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    wrapper = cast(WrapperState, module)
    kind, _ = _kind_and_config(wrapper, loading=True)
    inner_prefix = prefix + _SEGMENT
    # The post-load hook reports errors under the original names.
    _LOAD_ERRORS[module] = error_msgs
    group = wrapper._group
    if group is not None:
        group.reshard()  # the targets below must be the sharded parameters
    own = _own_by_key(wrapper)
    params = _own_params(wrapper)
    keys = [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner_prefix)]
    with torch.no_grad():
        for key in keys:
            value = state_dict.pop(key)
            rest = key[len(prefix) :]
            t = own.get(clean_fqn(rest))
            if t is not None:
                target = _current(t)
                value = _load_value(kind, key, value, target, params.get(id(target)))
            state_dict[inner_prefix + rest] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # Saved dicts carry cleaned module names; loading looks modules up by raw names.
        for raw, _ in module.named_modules(prefix=prefix[:-1] if prefix else ""):
            clean = clean_name(raw)
            if raw not in metadata and clean in metadata:
                metadata[raw] = metadata[clean]


def _post_load_hook(module: nn.Module, incompatible_keys: Any) -> None:
    """Missing / unexpected keys and error messages under the original names."""
    _kind_and_config(cast(WrapperState, module), loading=True)  # only for NO_SHARD's warning
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [clean_name(k) for k in keys]
    errors = _LOAD_ERRORS.pop(module, None)
    if errors is not None:
        errors[:] = [e.replace(_SEGMENT, "") for e in errors]


def register_state_dict_hooks(wrapper: nn.Module) -> None:
    """Install the save and load hooks on ``wrapper`` (see [Note: state-dict hooks])."""
    wrapper.register_state_dict_pre_hook(_pre_save_hook)  # type: ignore[no-untyped-call]
    wrapper.register_state_dict_post_hook(_post_save_hook)  # type: ignore[no-untyped-call]
    wrapper.register_load_state_dict_pre_hook(_pre_load_hook)  # type: ignore[no-untyped-call]
    wrapper.register_load_state_dict_post_hook(_post_load_hook)  # type: ignore[no-untyped-call]
