"""What one wrapper manages, and preparing it before the engine shards it.

A wrapper manages the modules under its wrapped module that are neither under
a nested wrapper nor ignored ("its own modules"), with their parameters and
buffers. Before ``fully_shard`` runs on them, as PyTorch's wrapper does:
meta-device modules are materialised (``param_init_fn`` or
``reset_parameters()``), tensors are moved to ``device_id``, and with
``sync_module_states`` rank 0's values are broadcast.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError, ConfigTypeError

__all__ = [
    "CHECKPOINT_WRAPPED",
    "WRAPPED_MODULE",
    "Ignored",
    "OwnTensor",
    "is_wrapper",
    "materialize_meta",
    "move_to_device",
    "own_modules",
    "own_tensors",
    "resolve_ignored",
    "sync_module_states",
]

#: The attribute a wrapper keeps its wrapped module under (PyTorch's name).
WRAPPED_MODULE = "_fsdp_wrapped_module"
#: Where torch's CheckpointWrapper keeps the module it checkpoints.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


def is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapper (it registers a wrapped module)."""
    return WRAPPED_MODULE in module._modules


class Ignored(NamedTuple):
    """The modules and parameters a wrapper leaves alone."""

    modules: set[nn.Module]
    params: set[nn.Parameter]


class OwnTensor(NamedTuple):
    """One parameter or buffer registered on one of a wrapper's own modules."""

    name: str  # relative to the wrapped module
    module: nn.Module
    attr: str
    is_param: bool


def resolve_ignored(root: nn.Module, ignored_modules: object, ignored_states: object) -> Ignored:
    """Validate ``ignored_modules`` / ``ignored_states`` and expand modules to
    every module and parameter under them."""
    if ignored_modules is not None and ignored_states is not None:
        raise ConfigError(  # PyTorch's words first (its tests match them)
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just pass "
            "ignored_states. (It takes modules or parameters.)"
        )
    source = ignored_states if ignored_states is not None else ignored_modules
    arg = "ignored_states" if ignored_states is not None else "ignored_modules"
    if source is None:
        return Ignored(set(), set())
    if isinstance(source, (torch.Tensor, nn.Module)) or not isinstance(source, Iterable):
        raise ConfigTypeError(f"{arg} must be an iterable of nn.Modules or nn.Parameters, got {type(source).__name__}.")
    items = list(source)
    mods = [x for x in items if isinstance(x, nn.Module)]
    params = [x for x in items if isinstance(x, nn.Parameter)]
    types = sorted({type(x).__name__ for x in items})
    # ValueErrors in PyTorch's words first, as FSDP1's (its tests match them)
    if arg == "ignored_modules" and len(mods) != len(items):
        raise ConfigError(
            f"ignored_modules expects nn.Module list elements but got types {types}; "
            "pass parameters with ignored_states."
        )
    if len(mods) + len(params) != len(items) or (mods and params):
        raise ConfigError(
            f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types {types}: "
            "pass only nn.Modules or only nn.Parameters."
        )
    modules: set[nn.Module] = set()
    for m in mods:
        if is_wrapper(m):
            raise ConfigError(
                f"`{arg}` should not include FSDP modules: {type(m).__name__} is already a "
                "FullyShardedDataParallel; ignore the module it wraps before wrapping it, or leave it wrapped."
            )
        if m is root:
            warnings.warn(
                "Trying to ignore the top-level module passed into the FSDP constructor itself will "
                f"result in all parameters being ignored and is not well-supported: {type(m).__name__} "
                "(nothing is left to shard).",
                stacklevel=4,
            )
        modules.update(m.modules())
    ignored_params = set(params)
    for m in modules:
        ignored_params.update(m.parameters(recurse=False))
    return Ignored(modules, ignored_params)


def own_modules(
    inner: nn.Module, ignored: set[nn.Module], every_path: bool = False
) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for ``inner`` and every module under it that no
    nested wrapper owns and that is not ignored, breadth-first: each module
    once, or with ``every_path`` once per name it is registered under (a
    module shared by two attributes, as ``state_dict`` lists it)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = {id(inner)}
    queue: collections.deque[tuple[str, nn.Module, frozenset[int]]] = collections.deque(
        [("", inner, frozenset({id(inner)}))]
    )
    while queue:
        name, module, path = queue.popleft()
        out.append((name, module))
        # (named_children() lists a module registered under two names once)
        for child_name, child in module._modules.items():
            if child is None or child in ignored or is_wrapper(child) or id(child) in (path if every_path else seen):
                continue
            seen.add(id(child))
            queue.append((f"{name}.{child_name}" if name else child_name, child, path | {id(child)}))
    return out


def own_tensors(
    inner: nn.Module, ignored: Ignored, *, persistent_only: bool = True
) -> list[OwnTensor]:
    """Every (name, tensor) registration on the wrapper's own modules (a tied
    parameter appears once per name), ignored parameters left out."""
    out: list[OwnTensor] = []
    ignored_ids = {id(p) for p in ignored.params}
    for prefix, module in own_modules(inner, ignored.modules, every_path=True):
        dot = f"{prefix}." if prefix else ""
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in ignored_ids:
                out.append(OwnTensor(dot + attr, module, attr, True))
        for attr, b in module._buffers.items():
            if b is None or (persistent_only and attr in module._non_persistent_buffers_set):
                continue
            out.append(OwnTensor(dot + attr, module, attr, False))
    return out


def _is_meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


def materialize_meta(
    inner: nn.Module,
    ignored: Ignored,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Materialise the wrapper's own modules if any of their tensors is on the
    meta device: with ``param_init_fn(module)`` per own module, else by
    allocating on ``device`` and calling each module's ``reset_parameters()``
    (tied parameters stay tied)."""
    owned = own_modules(inner, ignored.modules)
    ignored_ids = {id(p) for p in ignored.params}
    has_meta = any(
        _is_meta(p) and id(p) not in ignored_ids for _, m in owned for p in m._parameters.values()
    ) or any(_is_meta(b) for _, m in owned for b in m._buffers.values())
    if not has_meta:
        return
    if param_init_fn is not None and not callable(param_init_fn):  # checked where used, as by PyTorch
        raise ConfigError(
            f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}: param_init_fn must "
            "be a callable taking a module."
        )
    if param_init_fn is not None:
        for _, m in owned:
            param_init_fn(m)
        return
    memo: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, m in owned:
            touched = False
            for attr, p in m._parameters.items():
                if p is not None and _is_meta(p) and id(p) not in ignored_ids:
                    new = memo.get(id(p))
                    if new is None:
                        new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                        memo[id(p)] = new
                    m._parameters[attr] = new  # type: ignore[assignment]
                    touched = True
            for attr, b in m._buffers.items():
                if _is_meta(b):
                    m._buffers[attr] = torch.empty_like(b, device=device)  # type: ignore[arg-type]
                    touched = True
            reset = getattr(m, "reset_parameters", None)
            if touched and callable(reset):
                reset()
    left = [n for n, m in owned for t in (*m._parameters.values(), *m._buffers.values()) if _is_meta(t)]
    if left:
        raise ConfigError(
            f"modules {sorted(set(left))[:5]} still hold meta tensors after materialisation; give "
            "them a reset_parameters() method or pass param_init_fn=lambda m: "
            "m.to_empty(device=..., recurse=False) followed by your initialisation."
        )


def move_to_device(inner: nn.Module, ignored: Ignored, device: torch.device) -> None:
    """Move the wrapper's own parameters and buffers to ``device`` (tied
    parameters stay tied; ignored ones stay where they are)."""
    memo: dict[int, torch.Tensor] = {}
    ignored_ids = {id(p) for p in ignored.params}
    with torch.no_grad():
        for _, m in own_modules(inner, ignored.modules):
            for attr, p in m._parameters.items():
                if p is None or id(p) in ignored_ids or p.device == device or p.device.type == "meta":
                    continue
                new = memo.get(id(p))
                if new is None:
                    new = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                    memo[id(p)] = new
                m._parameters[attr] = new  # type: ignore[assignment]
            for attr, b in m._buffers.items():
                if b is not None and b.device != device and b.device.type != "meta":
                    m._buffers[attr] = b.to(device)


def sync_module_states(
    inner: nn.Module, ignored: Ignored, mesh: DeviceMesh
) -> None:
    """Broadcast the first mesh rank's own parameters and buffers, and the
    buffers of ignored modules (as FSDP1 does), to every rank of the mesh
    (over the shard group, then the replicate group)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in own_tensors(inner, ignored, persistent_only=False):
        value = (t.module._parameters if t.is_param else t.module._buffers)[t.attr]
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value.device.type == "meta":
            raise ConfigError(
                f"sync_module_states=True cannot broadcast {t.name}: it is on the meta device. "
                "Pass param_init_fn (or give the module reset_parameters()) so that it is "
                "materialised first."
            )
        tensors.append(value)
    # FSDP1 broadcasts every buffer under the module, those of ignored modules
    # too (not their parameters), in module order (the same on every rank).
    for module in inner.modules():
        if module in ignored.modules:
            for buf in module._buffers.values():
                if buf is not None and id(buf) not in seen and buf.device.type != "meta":
                    seen.add(id(buf))
                    tensors.append(buf)
    groups = [mesh.get_group(d) for d in reversed(range(mesh.ndim))]
    comm_device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    with torch.no_grad():
        for group in groups:
            if dist.get_world_size(group) == 1:
                continue
            _check_same_tensors(tensors, group, comm_device)
            src = dist.get_global_rank(group, 0)
            for value in tensors:
                # a tensor-parallel DTensor: its local piece, over the data-parallel
                # groups (its peers there hold the same piece), as FSDP1 syncs it
                local = value.to_local() if isinstance(value, DTensor) else value
                buf = local.detach()
                moved = buf.device != comm_device
                if moved:
                    buf = buf.to(comm_device)
                dist.broadcast(buf, src=src, group=group)
                if moved:
                    local.detach().copy_(buf)


def _check_same_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of ``group`` is about to broadcast as many tensors, of as
    many elements: checked first with one small all-reduce, so that ranks
    that built different modules (e.g. a ``param_init_fn`` that unties a tied
    weight on some ranks) raise alike instead of waiting on each other's
    broadcasts until the process group times out."""
    count, numel = len(tensors), sum(t.numel() for t in tensors)
    extremes = torch.tensor([count, -count, numel, -numel], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    hi_count, lo_count, hi_numel, lo_numel = extremes.tolist()
    if (hi_count, hi_numel) != (-lo_count, -lo_numel):
        raise ConfigError(
            f"sync_module_states=True: the ranks hold different parameters and buffers to broadcast "
            f"(between {-lo_count} and {hi_count} tensors, {-lo_numel} and {hi_numel} elements; this rank "
            f"{count} and {numel}). Every rank must build the same module before wrapping: a param_init_fn "
            "that materialises a shared (tied) weight twice, e.g. to_empty(recurse=False) on each module "
            "that holds it, unties it; tie the weights again in param_init_fn, or build them on every rank."
        )
