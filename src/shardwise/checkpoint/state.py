"""Model and optimizer state for sharded checkpoints: what is saved, and the
fresh tensors a checkpoint is loaded into before anything in memory changes.

What is saved is exactly what PyTorch's own helpers give, so a shardwise
checkpoint is an ordinary ``torch.distributed.checkpoint`` one (torchtitan's
layout)::

    {"model": get_model_state_dict(model),                 # FQN -> DTensor / tensor
     "optim": get_optimizer_state_dict(model, optimizer)}  # {"state": {FQN: {...}},
                                                           #  "param_groups": [...]}

DCP flattens nested keys (``optim.state.<fqn>.exp_avg``) and stores the
original key paths in its metadata (``planner_data``). Loading builds, from
that metadata and the live model, a *template* of fresh tensors with each
live tensor's sharding (so DCP reads only this rank's part, resharding as
needed), checks it against the model before reading anything, and returns
it to be copied into the model and optimizer once everything was read.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from shardwise.errors import CheckpointError
from shardwise.layout import dtensor_like

__all__ = [
    "MODEL_KEY",
    "OPTIM_KEY",
    "ShardedStateDictContext",
    "entries_under",
    "listing",
    "model_template",
    "optim_template",
    "optimizer_state_dict",
    "param_fqns",
    "register_sharded_state_dict",
    "sharded_state_dicts",
    "to_optimizer_state_dict",
]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
_MAX_LISTED = 8

Path_ = tuple[str | int, ...]

# Makes ``module.state_dict()`` / ``load_state_dict()`` hold sharded DTensors for the duration, for
# module kinds of a layer above this one; see register_sharded_state_dict.
ShardedStateDictContext = Callable[[nn.Module], contextlib.AbstractContextManager[object]]
_SHARDED_CONTEXTS: list[ShardedStateDictContext] = []


def register_sharded_state_dict(context: ShardedStateDictContext) -> None:
    """Let a front above this layer make its modules' state dicts sharded while
    a checkpoint reads or writes them. The wrapper API registers one: its
    modules' state dicts are ``FULL_STATE_DICT`` by default (whole tensors,
    gathered on every rank), and a sharded checkpoint of it must hold each
    rank's shards only, as ``fully_shard``'s does.

    Args:
        context: called with the model around every state-dict read and load
            of :func:`~shardwise.checkpoint.save` / :func:`~shardwise.checkpoint.load`;
            returns a context manager (a no-op for models it does not concern).
    """
    if context not in _SHARDED_CONTEXTS:
        _SHARDED_CONTEXTS.append(context)


@contextlib.contextmanager
def sharded_state_dicts(model: nn.Module) -> Iterator[None]:
    """Every registered :data:`ShardedStateDictContext` entered for ``model``."""
    with contextlib.ExitStack() as stack:
        for context in _SHARDED_CONTEXTS:
            stack.enter_context(context(model))
        yield


def listing(items: Iterable[str]) -> str:
    items = sorted(items)
    shown = ", ".join(repr(i) for i in items[:_MAX_LISTED])
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{shown}{more}"


def entries_under(metadata: Metadata, top: str, where: str) -> dict[Path_, Any]:
    """Storage metadata of every saved leaf under ``top``, keyed by its key path
    below ``top`` (e.g. ``("state", "fc.weight", "exp_avg")``)."""
    mapping = metadata.planner_data
    if not isinstance(mapping, dict):
        raise CheckpointError(
            f"{where}: its metadata has no key paths (planner_data); it was not saved by "
            "shardwise.checkpoint.save or DCP's default planner."
        )
    out: dict[Path_, Any] = {}
    for flat, md in metadata.state_dict_metadata.items():
        path = mapping.get(flat)
        if not isinstance(path, tuple) or not path:
            raise CheckpointError(f"{where}: its metadata has no key path for {flat!r}; it is corrupted.")
        if path[0] == top:
            out[tuple(path[1:])] = md
    return out


def _fresh(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor laid out (and, for a DTensor, sharded) like ``value``."""
    dtype = dtype or value.dtype
    if isinstance(value, DTensor):
        return dtensor_like(value, torch.empty(value.to_local().shape, dtype=dtype, device=value.to_local().device))
    return torch.empty(value.shape, dtype=dtype, device=value.device)


def _shape_problem(key: str, md: Any, value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        if not isinstance(md, TensorStorageMetadata):
            return f"{key!r} is a tensor in the model but not in the checkpoint"
        if tuple(md.size) != tuple(value.shape):
            return f"{key!r} has shape {list(md.size)} in the checkpoint but {list(value.shape)} in the model"
    elif isinstance(md, TensorStorageMetadata):
        return f"{key!r} is a tensor in the checkpoint but a {type(value).__name__} in the model"
    return None


def model_template(model_sd: dict[str, Any], metadata: Metadata, where: str) -> dict[str, Any]:
    """Fresh tensors for every entry of ``model_sd`` (the live, sharded model
    state dict), checked against the checkpoint: same keys, same shapes."""
    saved = entries_under(metadata, MODEL_KEY, where)
    saved_keys = {p[0] for p in saved if len(p) == 1 and isinstance(p[0], str)}
    if len(saved_keys) != len(saved):
        raise CheckpointError(f"{where}: its model state is nested; expected a flat FQN -> tensor dict.")
    if not saved:
        raise CheckpointError(f"{where} holds no model state.")
    problems = []
    missing = set(model_sd) - saved_keys
    unexpected = saved_keys - set(model_sd)
    if missing:
        problems.append(f"missing from the checkpoint: {listing(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {listing(unexpected)}")
    template: dict[str, Any] = {}
    for key, value in model_sd.items():
        if key not in saved_keys:
            continue
        md = saved[(key,)]
        problem = _shape_problem(key, md, value)
        if problem:
            problems.append(problem)
        elif isinstance(value, torch.Tensor):
            template[key] = _fresh(value)
        else:
            template[key] = value  # non-tensor (extra state): replaced by DCP
    if problems:
        raise CheckpointError(
            f"{where} does not fit this model (another model or configuration?): " + "; ".join(problems) + "."
        )
    return template


def _set_path(root: dict[str, Any], path: Path_, value: Any) -> None:
    """Put ``value`` at ``path``, creating dicts (str keys) and lists (int keys)."""
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            while len(node) <= key:  # type: ignore[operator]
                node.append(None)
            if node[key] is None:  # type: ignore[index]
                node[key] = empty  # type: ignore[index]
            node = node[key]  # type: ignore[index]
        else:
            node = node.setdefault(key, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:  # type: ignore[operator]
            node.append(None)
    node[last] = value


def param_fqns(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its FQN, as PyTorch's state-dict helpers name it (a
    tied parameter by its first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)``, except that an optimizer
    without state (it never stepped) is left alone: PyTorch's helper would
    initialise it with a zero-learning-rate step (Adam's step count becomes 1)."""
    if optimizer.state:
        osd: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
        return osd
    fqns = param_fqns(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        names = [fqns.get(id(p)) for p in group["params"]]
        if None in names:
            raise CheckpointError(
                f"optimizer parameter group {i} holds a parameter that is not in the model; "
                "pass the model the optimizer was built for."
            )
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": {}, "param_groups": groups}


def optim_template(model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata, where: str) -> dict[str, Any]:
    """Fresh tensors (and placeholders for non-tensors) for the saved optimizer
    state, shaped by the checkpoint and sharded like the live parameters."""
    saved = entries_under(metadata, OPTIM_KEY, where)
    if not saved:
        raise CheckpointError(
            f"{where} holds no optimizer state; load it with optimizer=None, or save with the optimizer."
        )
    fqns = param_fqns(model)
    by_fqn = {fqns[id(p)]: p for g in optimizer.param_groups for p in g["params"] if id(p) in fqns}
    problems = []
    unknown = sorted({str(p[1]) for p in saved if len(p) > 2 and p[0] == "state" and p[1] not in by_fqn})
    if unknown:
        problems.append(f"state for parameters this optimizer does not hold: {listing(unknown)}")
    template: dict[str, Any] = {}
    for path, md in saved.items():
        if not path or path[0] not in ("state", "param_groups"):
            problems.append(f"unexpected optimizer entry {'.'.join(map(str, path))!r}")
            continue
        if isinstance(md, BytesStorageMetadata):
            _set_path(template, path, None)  # replaced by DCP with the saved object
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"unknown storage for {'.'.join(map(str, path))!r}")
            continue
        param = by_fqn.get(path[1]) if path[0] == "state" and len(path) > 2 else None  # type: ignore[arg-type]
        if param is not None and tuple(md.size) == tuple(param.shape):
            value = _fresh(param, md.properties.dtype)
        else:
            # Not shaped like its parameter (e.g. Adam's step): read whole, everywhere.
            device = param.device if param is not None and not isinstance(param, DTensor) else torch.device("cpu")
            value = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=device)
        _set_path(template, path, value)
    if problems:
        raise CheckpointError(
            f"{where}: its optimizer state does not fit this optimizer: " + "; ".join(problems) + "."
        )
    return template


def to_optimizer_state_dict(
    loaded: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, where: str
) -> dict[str, Any]:
    """Turn loaded FQN-keyed optimizer state into ``optimizer.load_state_dict``'s
    index-keyed form, after checking that the parameter groups match."""
    fqns = param_fqns(model)
    saved_groups = loaded.get("param_groups") or []
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups as when saving."
        )
    groups = []
    index: dict[str, int] = {}
    for i, (saved_g, live_g) in enumerate(zip(saved_groups, optimizer.param_groups)):
        names = []
        for p in live_g["params"]:
            name = fqns.get(id(p))
            if name is None:
                raise CheckpointError(
                    f"optimizer parameter group {i} holds a parameter that is not in the model; "
                    "pass the model the optimizer was built for."
                )
            names.append(name)
        saved_names = saved_g.get("params") if isinstance(saved_g, dict) else None
        if saved_names != names:
            raise CheckpointError(
                f"{where}: optimizer parameter group {i} held {listing(saved_names or [])} when saved but "
                f"holds {listing(names)} now; build the optimizer over the same parameters in the same order."
            )
        ids = []
        for name in names:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**saved_g, "params": ids})
    state = {index[name]: value for name, value in (loaded.get("state") or {}).items()}
    return {"state": state, "param_groups": groups}
