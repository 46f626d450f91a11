"""The per-module API (SPEC §1): ``fully_shard`` and the ``FSDPModule`` methods."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from shardwise._engine.module_state import ModuleState, state_of, states_under
from shardwise._engine.param_group import ParamGroup
from shardwise._engine.sharded_param import ShardedParam
from shardwise.comm import AllGather, ReduceScatter
from shardwise.errors import (
    AlreadyShardedError,
    ConfigError,
    ConfigTypeError,
    UnsupportedError,
)
from shardwise.mesh import (
    MeshInfo,
    default_mesh,
    mesh_info,
    resolve_reshard_after_forward,
)
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "summon_full_params",
]

# original parameter -> description of the group that manages it, to refuse a
# parameter shared by two groups.
_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the
    all-gather and registers the unsharded parameters."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module passed to ``fully_shard``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Code that builds "another one of type(self)" (nn.Sequential slicing)
        # gets the original class, not an FSDP class with no state.
        mro = cls.__mro__
        orig = mro[mro.index(FSDPModule) + 1]
        if orig is object:
            return super().__new__(cls)
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> ModuleState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"No fully_shard state on {type(self).__name__}")
        return state

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        states = states_under(self) if recurse else [self._get_fsdp_state()]  # type: ignore[arg-type]
        return [s.group for s in states if s.group is not None]

    def reshard(self) -> None:
        """Free this module's unsharded parameters (if any) and register the
        sharded ones. Nothing happens if already sharded."""
        group = self._get_fsdp_state().group
        if group is not None:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.

        Args:
            async_op: return an :class:`UnshardHandle` at once; its ``wait()``
                finishes the gather. Forward waits for it too. (Default: ``False``)
        """
        group = self._get_fsdp_state().group
        if group is not None:
            group.reset_sharded_params()
            group.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(group)
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients. Off: gradients accumulate unsharded
        (in ``reduce_dtype`` if set) with no communication and are reduced once
        on the next backward with sync on (gradient accumulation). For HSDP this
        covers both the reduce-scatter and the all-reduce.

        Args:
            requires_gradient_sync: the new setting.
            recurse: also set it on every FSDP module below this one. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.requires_grad_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: whether to all-reduce across replicas after the reduce-scatter.
        Off: reduce-scattered sums accumulate until a backward with it on.

        Args:
            requires_all_reduce: the new setting.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free full parameters after forward (re-gathered for backward).

        Args:
            reshard_after_forward: the new setting (a bool).
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}; "
                "a group size can only be chosen in fully_shard(reshard_after_forward=...)."
            )
        states = states_under(self) if recurse else [self._get_fsdp_state()]  # type: ignore[arg-type]
        for state in states:
            state.auto_reshard_after_forward = False  # an explicit choice, also for the root
            if state.group is not None:
                state.group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free full parameters after backward. Off keeps them for the
        next forward (no all-gather), e.g. across gradient-accumulation steps.

        Args:
            reshard_after_backward: the new setting.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters at all (off for modules
        whose gradients and input-gradients need no parameters). (This module only.)"""
        group = self._get_fsdp_state().group
        if group is not None:
            group.unshard_in_backward = bool(unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step: only
        then does its end wait for pending gradient reductions (microbatching)."""
        self._get_fsdp_state().ctx.is_last_backward = bool(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit forward prefetch: these modules' all-gathers are issued right
        after this module's own, in pre-forward. Replaces the implicit order."""
        _set_prefetch(self, modules, "forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit backward prefetch: these modules' all-gathers are issued right
        after this module's own, in pre-backward. Replaces the implicit order."""
        _set_prefetch(self, modules, "backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the
        data-parallel size (this module only, not the ones below it)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ConfigError(f"gradient divide factor must be a positive number, got {factor!r}.")
        for group in self._groups(recurse=False):  # this module only, as PyTorch
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Old name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zero gradients for trainable parameters that got none in this
        backward, so ranks whose control flow used different parameters (MoE,
        multi-modal) still issue matching reduce-scatters (like DDP's
        ``find_unused_parameters``); those parameters then get a ``.grad``.

        Args:
            reduce_scatter_unused_params: the new setting.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters may be in flight while backward goes
        on (the memory <-> overlap dial). (Default: ``1``)

        Args:
            max_input_buffers: at least 1.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.max_pending_reductions = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run gradient reduce-scatters on their own process group (over the same
        ranks) so they can progress alongside all-gathers. Collective: call it
        on every rank of the mesh alike.

        Args:
            enable: ``True`` gives reduce-scatters their own group; ``False`` goes
                back to the shard group. (Default: ``True``)
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.set_separate_reduce_scatter_group(bool(enable))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility. shardwise takes every communication buffer
        from the module's ``Comm`` (see :meth:`set_custom_all_gather`); install a
        custom one to choose the allocator. Warns when enabled."""
        if enable:
            warnings.warn(
                "set_allocate_memory_from_process_group_for_comm has no effect in shardwise: "
                "buffers come from the module's Comm.allocate; install a custom AllGather / "
                "ReduceScatter to allocate from another pool.",
                stacklevel=2,
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for compatibility; has no effect (warns): shardwise does not
        allocate from symmetric memory. A custom ``AllGather`` can."""
        warnings.warn(
            f"set_symm_mem_for_comm({backend!r}) has no effect in shardwise; install a custom "
            "AllGather whose allocate() uses symmetric memory instead.",
            stacklevel=2,
        )

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for compatibility: shardwise always reduces with SUM and
        divides afterwards, so this changes nothing."""

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``hook`` on the reduced gradient buffer (after the reduce-scatter,
        or after HSDP's all-reduce) in place, before gradients are installed —
        e.g. to all-reduce over another mesh dimension. ``stream`` is accepted for
        compatibility; the hook runs on the current stream."""
        if not callable(hook):
            raise ConfigTypeError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}.")
        for group in self._groups(recurse=False):
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event recorded after the optimizer step: the next all-gathers wait on
        it instead of the whole stream (CUDA; harmless elsewhere)."""
        self._get_fsdp_state().ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Take over how this module's all-gathers allocate and communicate."""
        if not isinstance(comm, AllGather):
            raise ConfigTypeError(
                f"set_custom_all_gather expects a shardwise.AllGather, got {type(comm).__name__}."
            )
        for group in self._groups(recurse=False):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Take over how this module's reduce-scatters allocate and communicate."""
        if not isinstance(comm, ReduceScatter):
            raise ConfigTypeError(
                f"set_custom_reduce_scatter expects a shardwise.ReduceScatter, got {type(comm).__name__}."
            )
        for group in self._groups(recurse=False):
            group.reduce_scatter_comm = comm

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, call on the root: waits for
        collectives, reshards, and drops this iteration's trackers and pending
        gradients."""
        self._get_fsdp_state().reset_iter_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise AssertionError(
            "a fully_shard-ed module cannot be deep-copied (its shards, hooks and collectives "
            "are tied to this instance); copy the model before sharding, or save and load its "
            "state dict."
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Convert the shards, not a temporary full copy (e.g. the root's after forward).
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for state in states_under(self):  # type: ignore[arg-type]
            if state.group is not None:
                state.group.reset_sharded_params()
        return out


def _set_prefetch(module: FSDPModule, modules: list[FSDPModule], attr: str) -> None:
    if not isinstance(modules, (list, tuple)):
        raise ConfigTypeError(f"expected a list of FSDPModules, got {type(modules).__name__}.")
    groups = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ConfigError(f"Expects FSDPModule but got {type(m).__name__}: apply fully_shard to it first.")
        g = m._get_fsdp_state().group
        if g is not None:
            groups.append(g)
    group = module._get_fsdp_state().group
    if group is not None:
        setattr(group, attr, groups)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for compatibility with PyTorch (sharing CUDA streams between
    roots, e.g. pipeline stages): shardwise owns no streams (collectives run on
    the process group's), so there is nothing to share. Validates its input."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ConfigError(f"Expects list of FSDPModules but got {m}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the pre-/post-forward hooks around ``module.<method_name>`` too (e.g.
    ``generate``), not only around ``forward``. No-op for non-FSDP modules."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ConfigError(f"{type(module).__name__} has no method {method_name!r}.")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = module._get_fsdp_state()
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(orig(*args, **kwargs))

    setattr(module, method_name, wrapped)


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
    """Inside the context, ``module``'s FSDP parameters are whole, plain
    full-precision tensors registered on their modules (outside forward and
    backward only). On exit, changes are written back to the shards when
    ``writeback`` and the parameters are resharded.

    Used e.g. to initialise a model built on the meta device exactly as an
    eager build would: ``to_empty``, then run the init inside this context.
    Every rank holds the full parameters of every summoned group at once.

    Args:
        module: an FSDP module or a module containing some.
        recurse: also summon every FSDP module below ``module``. (Default: ``True``)
        writeback: copy modifications back to the shards on exit. (Default: ``True``)
    """
    states = states_under(module) if recurse else [s for s in [state_of(module)] if s is not None]
    groups = [s.group for s in states if s.group is not None]
    if not groups:
        raise ConfigError(
            f"summon_full_params: {type(module).__name__} has no fully_shard-ed parameters; "
            "apply fully_shard first."
        )
    for group in groups:
        group.reset_sharded_params()
    done: list[ParamGroup] = []
    try:
        for group in groups:
            group.summon()
            done.append(group)
        yield
        if writeback:
            for group in done:
                group.write_back()
    finally:
        for group in done:
            group.end_summon()


# ---- fully_shard ----------------------------------------------------------------
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shard ``module``'s parameters across the mesh (FSDP / ZeRO-3).

    The parameters of ``module`` that no nested ``fully_shard``-ed module owns
    form one communication group: all-gathered in one collective before its
    forward (and before its backward if resharded), their gradients
    reduce-scattered in one collective after its backward. Apply bottom-up:
    blocks first, then the root. Each parameter is replaced by a ``DTensor``
    with ``Shard(0)`` placement (rank r holds ``torch.chunk(param, ws)[r]``), so
    ``state_dict()``, optimizers and ``clip_grad_norm_`` work unchanged. The
    module's class becomes a subclass of :class:`FSDPModule` and of its own.

    Args:
        module: the module, or a list of modules to group together.
        mesh: a 1-D mesh (shard over it) or 2-D ``(replicate, shard)`` mesh
            (HSDP). (Default: ``None``: the world on the default device type)
        reshard_after_forward: ``True`` frees full parameters after forward;
            ``False`` keeps them until after backward; an ``int`` reshards to a
            group of that many ranks after forward. (Default: ``None``: ``True``
            except for the root, which keeps them)
        shard_placement_fn: maps a parameter to ``Shard(dim)`` to shard it on
            another dim; ``None`` from it means ``Shard(0)``. (Default: ``None``)
        mp_policy: mixed precision. (Default: ``MixedPrecisionPolicy()``: none)
        offload_policy: ``CPUOffloadPolicy()`` keeps shards, gradients and
            optimizer state on the CPU. (Default: ``OffloadPolicy()``: none)
        ignored_params: parameters left unsharded and unmanaged. Parameters
            that are not ``module``'s have no effect on it (one set may serve
            every call for a model, as with PyTorch); a tensor that is no
            parameter at all (``param.data``, a ``state_dict()`` value, a
            copy) raises ``ValueError``. (Default: ``None``)
        dp_mesh_dims: a :class:`DataParallelMeshDims` (or PyTorch's): ``mesh``
            is then the whole SPMD mesh, parameters are DTensors on it with
            ``Replicate()`` on these dims, and FSDP shards over ``shard`` (and
            all-reduces over ``replicate``). One name each. (Default: ``None``)

    Returns:
        ``module`` itself (now also an ``FSDPModule``).
    """
    modules = _check_modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ConfigTypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}.")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ConfigTypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}.")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ConfigError(
            "reshard_after_forward should be a bool, None, or an int giving the group size to "
            f"reshard to after forward, not {reshard_after_forward!r}."
        )
    info = mesh_info(mesh if mesh is not None else default_mesh(), dp_mesh_dims)
    auto = reshard_after_forward is None
    if info.spmd_mesh is not None and not isinstance(reshard_after_forward, bool) and isinstance(
        reshard_after_forward, int
    ):
        raise UnsupportedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims); "
            "pass True or False."
        )
    raf = resolve_reshard_after_forward(True if auto else reshard_after_forward, info)
    ignored = _check_ignored(ignored_params, modules)
    conflicts: list[str] = []
    collected = _collect_params(modules, ignored, conflicts, None if info.spmd_mesh is not None else info.mesh)
    # Trainable dtypes are checked at the first forward, as PyTorch does
    # (requires_grad may still change until then).
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    storage_device = torch.device("cpu") if offload else info.device
    params = _make_sharded_params(collected, info, shard_placement_fn, storage_device)
    _move_buffers(modules, info.device)

    group = None
    desc = f"{type(modules[0]).__name__}"
    if params:
        # Pinned host shards let the host-to-device copy overlap compute (CUDA only).
        pin = offload and offload_policy.pin_memory and torch.cuda.is_available()  # type: ignore[attr-defined]
        group = ParamGroup(params, modules, info, info.device, mp_policy, raf, storage_device, desc, pin)
    for orig, *_ in collected:
        _OWNED[orig] = desc
    for managed in _managed_modules(modules):
        # What PyTorch sets on every module it manages (dynamo and tools read them).
        managed._is_fsdp_managed_module = True  # type: ignore[assignment]
        managed._fsdp_use_orig_params = True  # type: ignore[assignment]
    state = ModuleState(modules, group, mp_policy, auto, info.device)
    if conflicts:
        state.deferred_error = conflicts[0]
    for m in modules:
        cls = type(m)
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _FSDP_CLASSES[cls] = fsdp_cls
        m.__class__ = fsdp_cls
    return module


def _check_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ConfigError("fully_shard got an empty list of modules; pass at least one nn.Module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ConfigTypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}.")
        if state_of(m) is not None:
            raise AlreadyShardedError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per "
                "module (to group several modules, pass them together as a list)."
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ConfigError(
                f"fully_shard does not support containers without forward ({type(m).__name__}); "
                "apply it to the modules inside, or pass them as a list: fully_shard(list(container))."
            )
    return modules


def _managed_modules(modules: tuple[nn.Module, ...]) -> list[nn.Module]:
    """``modules`` and their submodules not under a nested fully_shard."""
    out: list[nn.Module] = []
    stack = list(modules)
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(c for c in m.children() if state_of(c) is None)
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


def _collect_params(
    modules: tuple[nn.Module, ...], ignored: set[int], conflicts: list[str], dp_mesh: DeviceMesh | None = None
) -> list[Collected]:
    """Parameters of ``modules`` not owned by a nested fully_shard, with every
    place each is registered; validated before anything is changed. Parameters
    that another group already manages are described in ``conflicts``."""
    found: dict[int, Collected] = {}
    seen_modules: set[int] = set()

    def visit(mod: nn.Module, prefix: str, top: bool) -> None:
        if id(mod) in seen_modules:
            return
        seen_modules.add(id(mod))
        if not top and state_of(mod) is not None:
            return  # owned by a nested fully_shard
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            if id(p) in found:
                found[id(p)][1].append((mod, name))
                continue
            if isinstance(p, DTensor) and _on_data_parallel_mesh(p, dp_mesh):
                raise ConfigError(
                    f"parameter {fqn!r} is already a DTensor on {p.device_mesh} "
                    f"{tuple(p.placements)}, which shares mesh dims with fully_shard's mesh "
                    f"{dp_mesh}. If it is already sharded: apply fully_shard bottom-up (inner "
                    "modules first, then their parents), once per module. If it is tensor "
                    "parallel: pass fully_shard only the data-parallel dims of the same mesh "
                    "(TP on mesh['tp'] -> mesh=mesh['dp']), or the whole mesh with dp_mesh_dims."
                )
            owner = _OWNED.get(p)  # type: ignore[no-untyped-call]
            if owner is not None:
                # Left unmanaged here; reported at the first forward, as PyTorch does.
                conflicts.append(
                    f"parameter {fqn!r} is shared with another fully_shard group ({owner}); a "
                    "parameter must belong to one group. Put all modules that use it in one "
                    "group: fully_shard([module_a, module_b]), or shard only their common parent."
                )
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

    for i, m in enumerate(modules):
        visit(m, f"[{i}]." if len(modules) > 1 else "", True)
    collected = list(found.values())
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


def _make_sharded_params(
    collected: list[Collected],
    info: MeshInfo,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    storage_device: torch.device,
) -> list[ShardedParam]:
    params = []
    for p, owners, fqn in collected:
        dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise ConfigTypeError(
                        f"shard_placement_fn must return Shard(dim) or None, got {placement!r} for {fqn}."
                    )
                dim = placement.dim if placement.dim >= 0 else placement.dim + p.ndim
                if not 0 <= dim < p.ndim:
                    raise ConfigError(
                        f"shard_placement_fn returned Shard({placement.dim}) for {fqn} of shape "
                        f"{tuple(p.shape)}; the dim must be in [-{p.ndim}, {p.ndim})."
                    )
                local_shape = (p._local_tensor if isinstance(p, DTensor) else p).shape
                if dim != 0 and local_shape[dim] % info.shard_size != 0:
                    raise UnsupportedError(
                        f"FSDP does not support uneven sharding on dim {dim}: {fqn} has shape "
                        f"{tuple(p.shape)} and the shard group has {info.shard_size} ranks (as in "
                        "PyTorch). Shard it on dim 0, or on a dim its size divides evenly."
                    )
        sp = ShardedParam(p, owners, info, dim, fqn)
        src = sp.initial_source
        if src is not None and src.device.type != "meta" and src.device != storage_device:
            sp.initial_source = src.detach().to(storage_device)
        params.append(sp)
    return params
