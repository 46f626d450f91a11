"""Optimizer state dicts for the wrapper API.

An optimizer built on a wrapped model holds the sharded ``DTensor``
parameters, so its own ``state_dict()`` is already sharded: keyed by
parameter index, with ``DTensor`` state (``exp_avg``, ...) and plain scalars
(``step``). These functions convert between that and PyTorch FSDP's saved
forms, keyed by the original parameter names:

========================  =======================================================
``StateDictType``         state values (non-scalar tensors)
========================  =======================================================
FULL_STATE_DICT           whole tensors (gathered; on CPU unless
                          ``offload_to_cpu=False``; ``rank0_only``: ``{}`` elsewhere)
SHARDED_STATE_DICT        sharded ``DTensor`` s, as the optimizer holds them
LOCAL_STATE_DICT          this rank's shards as plain tensors
========================  =======================================================

``param_groups`` keep their hyper-parameters; their ``"params"`` become names.
Loading (:func:`optim_state_dict_to_load` and the older
``shard_full_optim_state_dict`` / ``scatter_full_optim_state_dict`` /
``flatten_sharded_optim_state_dict``) goes back to indices and this rank's
shards, ready for ``optim.load_state_dict``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise._engine.module_state import states_under
from shardwise._engine.sharded_param import ShardedParam
from shardwise.errors import ConfigError, ConfigTypeError, UsageError
from shardwise.layout import dtensor_like

from .config import OptimStateKeyType, StateDictType
from .state_dict import _load_value, check_local_without_mesh, clean_fqn, settings_of, sharded_params, whole, wrappers_under

__all__ = [
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]

OptimInput = Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None


# ---- PyTorch's deprecation warnings, in its words ----------------------------------
def _warn_legacy(old: str, new: str) -> None:
    """FSDP1 warns ``FutureWarning`` on its older optimizer-state functions;
    so do we, pointing at the caller's line."""
    warnings.warn(
        f"``FullyShardedDataParallel.{old}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{new}``. ``FullyShardedDataParallel.{old}`` "
        "may be removed after PyTorch 2.2.",
        FutureWarning,
        stacklevel=3,
    )


def _warn_optim_input(optim_input: OptimInput) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=3,
        )


# ---- parameters and names ----------------------------------------------------------
def _ensure_sharded(model: nn.Module) -> None:
    """The optimizer holds the sharded parameters: register them (a forward
    may have left the root's gathered ones registered)."""
    for state in states_under(model):
        for group in state.groups:
            group.reshard()


def _names(model: nn.Module) -> dict[int, str]:
    """Parameter (by id) -> its first original name in ``model``."""
    names: dict[int, str] = {}
    for name, p in nn.Module.named_parameters(model):
        names.setdefault(id(p), clean_fqn(name))
    return names


def _params_of(optim: torch.optim.Optimizer | None, optim_input: OptimInput, model: nn.Module) -> list[torch.Tensor]:
    """Parameters in optimizer-index order: ``optim``'s, else ``optim_input``'s,
    else ``model.parameters()``."""
    if optim is not None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise ConfigTypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}.")
        return [p for g in optim.param_groups for p in g["params"]]
    if optim_input is not None:
        items = list(optim_input)
        if items and isinstance(items[0], dict):
            return [p for g in items for p in g["params"]]  # type: ignore[index]
        return items  # type: ignore[return-value]
    return list(model.parameters())


def _index_to_name(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    names = _names(model)
    out = []
    for i, p in enumerate(params):
        name = names.get(id(p))
        if name is None:
            raise ConfigError(
                f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter of "
                f"{type(model).__name__}; build the optimizer on model.parameters() after wrapping."
            )
        out.append(name)
    return out


def _name_to_index(model: nn.Module, params: list[torch.Tensor]) -> dict[str, int]:
    names = _names(model)
    return {names[id(p)]: i for i, p in enumerate(params) if id(p) in names}


def _check_osd(osd: object, arg: str) -> dict[str, Any]:
    """An optimizer state dict: its 'state' at least ('param_groups' may be
    left out, as PyTorch's FSDP allows; the result then has none either)."""
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict):
        raise ConfigTypeError(
            f"{arg} must be an optimizer state dict with 'state' (and 'param_groups'), got "
            f"{type(osd).__name__}{' with keys ' + str(sorted(osd)) if isinstance(osd, dict) else ''}."
        )
    return osd


# ---- to names ---------------------------------------------------------------------
def _export(value: Any, kind: StateDictType, offload: bool, sp: ShardedParam | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        # A copy: a loaded optimizer must not share (and double-count) ``step``.
        return value.detach().clone().cpu() if offload else value.detach().clone()
    if isinstance(value, DTensor):
        if kind == StateDictType.FULL_STATE_DICT:
            value = whole(value, sp)  # (a tensor-parallel parameter's stays TP-sharded, as FSDP1's)
        elif kind == StateDictType.LOCAL_STATE_DICT:
            value = value.to_local()
        else:
            if offload and value.device.type != "cpu":
                value = dtensor_like(value, value.to_local().cpu())
            return value
    return value.cpu() if offload else value


def _check_local(model: nn.Module, kind: StateDictType) -> None:
    for w in wrappers_under(model)[:1]:  # FSDP1 checks the first (root) wrapper
        check_local_without_mesh(w, kind)


def _fsdp1_order(units: dict[str, int | None]) -> list[str]:
    """The order of FSDP1's (``use_orig_params``) optimizer state: by name,
    except that parameters no wrapper manages (ignored ones) come first, then
    each wrapper's parameters together, wrappers in the order of their
    first name. ``units``: each name's wrapper (any id), None if unmanaged."""
    ordered = sorted(units)
    by_unit: dict[int, list[str]] = {}
    for name in ordered:
        unit = units[name]
        if unit is not None:
            by_unit.setdefault(unit, []).append(name)
    return [name for name in ordered if units[name] is None] + [n for names in by_unit.values() for n in names]


def _rank0_names(names: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """Rank 0's names with optimizer state, after checking (a collective over
    ``group``, the default one if None, as FSDP1's) that every rank holds
    state for each of them; FSDP1's words."""
    lists: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, names, group=group)
    first = set(lists[0] or ())
    missing = {rank: sorted(first - set(got or ())) for rank, got in enumerate(lists)}
    if any(missing.values()):
        raise UsageError(
            "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's "
            "optimizer but some ranks are missing some of those states"
            + "".join(f"\nRank {r} is missing states for the parameters: {m}" for r, m in missing.items() if m)
            + "\n(build every rank's optimizer over the same parameters.)"
        )
    return list(lists[0] or ())


def _to_named(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any],
    kind: StateDictType,
    rank0_only: bool,
    offload: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    _check_osd(osd, "optim_state_dict")
    _ensure_sharded(model)
    params = _params_of(optim, None, model)
    names = _index_to_name(model, params)
    unit_of = {id(sp.sharded_param): id(s) for s in states_under(model) for g in s.groups for sp in g.params}
    index_of: dict[str, int] = {}
    units: dict[str, int | None] = {}
    for index in osd["state"]:
        if not isinstance(index, int) or not 0 <= index < len(names):
            raise ConfigError(
                f"optimizer state key {index!r} is not an index of the optimizer's {len(names)} "
                "parameters; pass optim.state_dict() of this optimizer."
            )
        index_of[names[index]] = index
        units[names[index]] = unit_of.get(id(params[index]))
    # By name, in FSDP1's order (param_groups keep theirs): each rank's
    # optimizer may list the parameters in its own order. Full tensors are
    # gathered for rank 0's names, which every rank must hold.
    order = _fsdp1_order(units)
    common = set(_rank0_names(order, group))
    if kind == StateDictType.FULL_STATE_DICT:
        order = [name for name in order if name in common]
    # FSDP1 lists a flat parameter's states by name (exp_avg, exp_avg_sq, step).
    flat = {
        id(sp.sharded_param) for w in wrappers_under(model) if not getattr(w, "_use_orig_params", True)
        and w._group is not None for sp in w._group.params
    }
    sps = sharded_params(model)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for name in order:
            index = index_of[name]
            entry = osd["state"][index]
            keys = sorted(entry) if id(params[index]) in flat else list(entry)
            sp = sps.get(id(params[index]))
            state[name] = {k: _export(entry[k], kind, offload, sp) for k in keys}
    out: dict[str, Any] = {"state": state}
    if "param_groups" in osd:
        out["param_groups"] = []
        for g in osd["param_groups"]:
            entry = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            entry["params"] = [names[i] for i in g["params"]]
            out["param_groups"].append(entry)
    if kind == StateDictType.FULL_STATE_DICT and rank0_only and dist.get_rank() != 0:
        return {}
    return out


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by original parameter names, in the form the
    model's state-dict type says (``FullyShardedDataParallel.state_dict_type``).
    A collective for full state dicts: call it on every rank.

    Args:
        model: the root module whose parameters ``optim`` steps.
        optim: the optimizer.
        optim_state_dict: the state dict to convert. (Default: ``None``: ``optim.state_dict()``)
        group: the ranks that check they hold the same states (the parameters' own
            meshes gather them). (Default: ``None``: the default group)
    """
    settings = settings_of(model, "optim_state_dict")
    _check_local(model, settings.state_dict_type)
    cfg = settings.optim_state_dict_config
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    return _to_named(
        model, optim, osd, settings.state_dict_type, getattr(cfg, "rank0_only", False), cfg.offload_to_cpu, group
    )


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The whole optimizer state keyed by parameter names, on the CPU; with
    ``rank0_only`` the other ranks return ``{}``. A collective.

    Args:
        model: the root module.
        optim: its optimizer.
        optim_input: ignored (deprecated in PyTorch). (Default: ``None``)
        rank0_only: only rank 0 returns the state. (Default: ``True``)
        group: as for :func:`optim_state_dict`. (Default: ``None``)
    """
    _warn_legacy("full_optim_state_dict", "optim_state_dict")
    _warn_optim_input(optim_input)
    return _to_named(model, optim, optim.state_dict(), StateDictType.FULL_STATE_DICT, rank0_only, True, group)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """The optimizer state keyed by parameter names with sharded ``DTensor``
    values (pair it with a ``SHARDED_STATE_DICT`` model state dict).

    Args:
        model: the root module.
        optim: its optimizer.
        group: as for :func:`optim_state_dict`. (Default: ``None``)
    """
    _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
    return _to_named(model, optim, optim.state_dict(), StateDictType.SHARDED_STATE_DICT, False, False, group)


# ---- back to indices ----------------------------------------------------------------
def _import(kind: StateDictType, key: str, value: Any, target: torch.Tensor, sp: ShardedParam | None) -> Any:
    """One state value for ``target``'s optimizer slot. Always a copy: the
    optimizer updates its state in place, and must neither write into the
    dict it was given nor share a ``step`` tensor with another optimizer."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if value.dim() == 0:
        return value.clone()
    if isinstance(value, ShardedTensor):
        return _from_sharded_tensor(key, value, target)
    if kind == StateDictType.SHARDED_STATE_DICT and value.shape == target.shape:
        # As FSDP1, across wrappings: a whole tensor (the state of a parameter
        # no wrapper held where the dict was saved) loads as a full one, and
        # a sharded one into a parameter no wrapper holds here whole (a
        # collective: the state's keys come in the same order on every rank).
        if isinstance(value, DTensor) and not isinstance(target, DTensor):
            return value.full_tensor().to(target.device)
        if not isinstance(value, DTensor):
            kind = StateDictType.FULL_STATE_DICT
    return _load_value(kind, key, value, target, sp).clone()


def _from_sharded_tensor(key: str, value: ShardedTensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a ``ShardedTensor`` (what DCP's
    ``load_sharded_optimizer_state_dict`` gives, cut in chunks of dim 0 as
    FSDP1's shards are), read from its local shards without communication:
    a copy laid out as ``target``."""
    if value.shape != target.shape:
        raise ConfigError(
            f"optimizer state {key!r} has shape {tuple(value.shape)}, but its parameter has shape "
            f"{tuple(target.shape)}; load a state saved from this model."
        )
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    else:
        shape, offset = tuple(target.shape), (0,) * target.dim()
    for shard in value.local_shards():
        meta = shard.metadata
        starts, sizes = meta.shard_offsets, meta.shard_sizes
        if all(s <= o and o + n <= s + m for s, m, o, n in zip(starts, sizes, offset, shape)):
            piece = shard.tensor
            for dim, (s, o, n) in enumerate(zip(starts, offset, shape)):
                piece = piece.narrow(dim, o - s, n)
            local = piece.to(target.device).clone()
            return dtensor_like(target, local) if isinstance(target, DTensor) else local
    raise ConfigError(
        f"optimizer state {key!r} is a ShardedTensor whose local shards here "
        f"({[(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in value.local_shards()]}) do not hold "
        f"this rank's piece of its parameter (offsets {list(offset)}, shape {list(shape)}); load it on the "
        "same ranks and sharding it was made for, or read it with torch.distributed.checkpoint.load into "
        "FullyShardedDataParallel.optim_state_dict(model, optim) under SHARDED_STATE_DICT."
    )


def _to_loadable(
    model: nn.Module, params: list[torch.Tensor], osd: dict[str, Any], kind: StateDictType
) -> dict[str, Any]:
    _check_osd(osd, "optim_state_dict")
    _ensure_sharded(model)
    index = _name_to_index(model, params)
    sps = sharded_params(model)
    state: dict[int, Any] = {}
    with torch.no_grad():
        for name, entry in osd["state"].items():
            i = index.get(name) if isinstance(name, str) else None
            if i is None:
                raise ConfigError(
                    f"optimizer state for {name!r} matches no parameter the optimizer holds; names must "
                    "be the model's original parameter names (rekey an index-keyed dict with "
                    "rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model))."
                )
            target = params[i]
            sp = sps.get(id(target))
            state[i] = {k: _import(kind, f"{name}.{k}", v, target, sp) for k, v in entry.items()}
    out: dict[str, Any] = {"state": dict(sorted(state.items()))}  # in the optimizer's order, as its own
    if "param_groups" in osd:
        out["param_groups"] = []
        for g in osd["param_groups"]:
            entry = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            missing = [n for n in g["params"] if n not in index]
            if missing:
                raise ConfigError(
                    f"param_groups name parameters {missing[:4]} that the optimizer does not hold; load into "
                    "an optimizer built the same way on the same model."
                )
            entry["params"] = sorted(index[n] for n in g["params"])
            out["param_groups"].append(entry)
    return out


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Convert a state dict from :func:`optim_state_dict` (same state-dict
    type) into one ``optim.load_state_dict`` takes: indices and this rank's shards.

    Args:
        model: the root module.
        optim: the optimizer to load into.
        optim_state_dict: the named state dict (for full ones with
            ``rank0_only``, only rank 0's is read).
        is_named_optimizer: not supported (``True`` raises). (Default: ``False``)
        load_directly: also call ``optim.load_state_dict``. (Default: ``False``)
        group: for ``rank0_only``, the group to broadcast over. (Default: ``None``: the world)
    """
    if is_named_optimizer:
        raise ConfigError(
            "is_named_optimizer=True (TorchRec KeyedOptimizer / NamedOptimizer) is not supported; "
            "pass a torch.optim.Optimizer."
        )
    settings = settings_of(model, "optim_state_dict_to_load")
    kind = settings.state_dict_type
    _check_local(model, kind)
    osd = optim_state_dict
    if kind == StateDictType.FULL_STATE_DICT and getattr(settings.optim_state_dict_config, "rank0_only", False):
        osd = _broadcast_from_rank0(osd, group)
    result = _to_loadable(model, _params_of(optim, None, model), osd, kind)
    if load_directly:
        optim.load_state_dict(result)
    return result


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's part of a full, name-keyed optimizer state dict (every rank
    holds the full dict), ready for ``optim.load_state_dict``.

    Args:
        full_optim_state_dict: from :func:`full_optim_state_dict`.
        model: the (wrapped) root module.
        optim_input: the optimizer's parameters or groups, if ``optim`` is not
            given. (Default: ``None``: ``model.parameters()``)
        optim: the optimizer that will load it. (Default: ``None``)
    """
    _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    params = _params_of(optim, optim_input, model)
    return _to_loadable(model, params, full_optim_state_dict, StateDictType.FULL_STATE_DICT)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """A name-keyed sharded optimizer state dict (from
    :func:`sharded_optim_state_dict`), ready for ``optim.load_state_dict``.

    Args:
        sharded_optim_state_dict: the sharded state dict.
        model: the root module.
        optim: the optimizer that will load it.
    """
    _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return _to_loadable(model, _params_of(optim, None, model), sharded_optim_state_dict, StateDictType.SHARDED_STATE_DICT)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    """Like :func:`shard_full_optim_state_dict`, but only rank 0 (of
    ``group``) needs the full dict (the others may pass ``None``); it is
    broadcast. A collective.

    Args:
        full_optim_state_dict: the full dict on rank 0.
        model: the root module.
        optim_input: see :func:`shard_full_optim_state_dict`. (Default: ``None``)
        optim: the optimizer that will load it. (Default: ``None``)
        group: the group to broadcast over. (Default: ``None``: the world)
    """
    _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    osd = _broadcast_from_rank0(full_optim_state_dict, group)
    return _to_loadable(model, _params_of(optim, optim_input, model), osd, StateDictType.FULL_STATE_DICT)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key ``optim_state_dict`` by parameter names (``PARAM_NAME``) or
    optimizer indices (``PARAM_ID``), e.g. to load a full dict into an
    unwrapped model's optimizer and back.

    Args:
        optim_state_dict: the state dict.
        optim_state_key_type: the key type wanted.
        model: the model whose parameter names are used (wrapped or not).
        optim_input: the optimizer's parameters or groups. (Default: ``None``)
        optim: the optimizer whose indices are used. (Default: ``None``:
            ``optim_input``, else ``model.parameters()``)
    """
    _warn_optim_input(optim_input)
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise ConfigTypeError(
            f"optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, got {optim_state_key_type!r}."
        )
    osd = _check_osd(optim_state_dict, "optim_state_dict")
    keys = list(osd["state"])
    if not (all(isinstance(k, str) for k in keys) or all(isinstance(k, int) for k in keys)):
        raise ConfigError(f"optimizer state keys must be all names or all indices, got {keys[:6]}.")
    by_name = bool(keys) and isinstance(keys[0], str)
    wants_name = optim_state_key_type == OptimStateKeyType.PARAM_NAME
    if not keys or by_name == wants_name:
        return osd
    _ensure_sharded(model)
    params = _params_of(optim, optim_input, model)
    if wants_name:
        names = _index_to_name(model, params)
        new_state = {names[i]: v for i, v in osd["state"].items()}
        convert: Any = lambda ps: sorted(names[i] for i in ps)
    else:
        index = _name_to_index(model, params)
        new_state = {index[n]: v for n, v in osd["state"].items()}
        convert = lambda ps: sorted(index[n] for n in ps)
    if "param_groups" not in osd:
        return {"state": new_state}
    groups = copy.deepcopy(osd["param_groups"])
    for g in groups:
        g["params"] = convert(g["params"])
    return {"state": new_state, "param_groups": groups}


# ---- broadcast ------------------------------------------------------------------------
@dataclass(frozen=True)
class _TensorSpec:
    """A tensor left out of the broadcast object, sent separately."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _broadcast_from_rank0(osd: dict[str, Any] | None, group: Any) -> dict[str, Any]:
    """Send rank 0's ``osd`` to every rank of ``group``: its structure as an
    object, its tensors one by one (on the communication device)."""
    group = group or dist.group.WORLD
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensors: list[torch.Tensor] = []
    if dist.get_rank() == src:
        leaves, spec = tree_flatten(_check_osd(osd, "full_optim_state_dict (on rank 0)"))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        pieces = sum(isinstance(x, DTensor) for x in tensors)
        box: list[Any] = [
            tree_unflatten([_TensorSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves], spec),
            pieces,
        ]
    else:
        box = [None, 0]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[1]:  # every rank learns it, so every rank raises (PyTorch's FSDP1 waits forever here)
        raise UsageError(
            f"rank 0's full optimizer state holds {box[1]} DTensors (the state of tensor-parallel "
            "parameters, kept split over the TP mesh): rank 0's own TP pieces only, so the other TP "
            "ranks' state is not there to send. Save it with rank0_only=False (each rank keeps its own TP piece) "
            "and load that on every rank, or use SHARDED_STATE_DICT."
        )
    skeleton, spec = tree_flatten(box[0])
    out, k = [], 0
    for leaf in skeleton:
        if not isinstance(leaf, _TensorSpec):
            out.append(leaf)
            continue
        if dist.get_rank() == src:
            buf = tensors[k].detach().to(device)
            k += 1
        else:
            buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        out.append(buf.cpu())
    return tree_unflatten(out, spec)  # type: ignore[no-any-return]
