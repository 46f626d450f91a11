"""The per-module API (SPEC §1): ``fully_shard`` and the ``FSDPModule`` methods."""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardwise._engine.collectives import is_default
from shardwise._engine.module_state import ModuleState, dynamo_disable, state_of, states_under
from shardwise._engine.param_group import ParamGroup
from shardwise._engine.setup import shard_modules
from shardwise.comm import AllGather, ReduceScatter, accepts_as
from shardwise.errors import AlreadyShardedError, ConfigError, ConfigTypeError, CustomCommError
from shardwise.mesh import default_mesh
from shardwise.policies import MixedPrecisionPolicy, OffloadPolicy, as_policy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "summon_full_params",
]

_FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes
    the all-gather and registers the unsharded parameters. As PyTorch's, the
    public class is a base whose own ``wait()`` does nothing (code may build
    one for a module with nothing to gather)."""

    def wait(self) -> None:
        return


class _UnshardHandleImpl(UnshardHandle):
    """The handle of an unshard in flight, over its groups."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    @dynamo_disable
    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


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
        return [g for s in states for g in s.groups]

    def reshard(self) -> None:
        """Free this module's unsharded parameters (if any) and register the
        sharded ones. Nothing happens if already sharded, also while an
        ``unshard(async_op=True)`` is still gathering: as with PyTorch, its
        ``wait()`` (or the next forward) then registers the unsharded ones."""
        for group in self._get_fsdp_state().groups:
            if not group.gathering:
                group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.

        Args:
            async_op: return an :class:`UnshardHandle` at once; its ``wait()``
                finishes the gather. Forward waits for it too. (Default: ``False``)
        """
        groups = self._get_fsdp_state().groups
        for group in groups:
            group.reset_sharded_params()
            group.unshard(async_op=async_op)
        if async_op:
            return _UnshardHandleImpl(list(groups))
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
            group.settings.requires_grad_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: whether to all-reduce across replicas after the reduce-scatter.
        Off: reduce-scattered sums accumulate until a backward with it on.

        Args:
            requires_all_reduce: the new setting.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.settings.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free full parameters after forward (re-gathered for backward).

        Args:
            reshard_after_forward: the new setting (a bool).
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}: "
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}; "
                "a group size can only be chosen in fully_shard(reshard_after_forward=...)."
            )
        states = states_under(self) if recurse else [self._get_fsdp_state()]  # type: ignore[arg-type]
        for state in states:
            state.auto_reshard_after_forward = False  # an explicit choice, also for the root
            for group in state.groups:
                group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free full parameters after backward. Off keeps them for the
        next forward (no all-gather), e.g. across gradient-accumulation steps.

        Args:
            reshard_after_backward: the new setting.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        for group in self._groups(recurse):
            group.settings.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters at all (off for modules
        whose gradients and input-gradients need no parameters). (This module only.)"""
        for group in self._groups(recurse=False):
            group.settings.unshard_in_backward = bool(unshard_in_backward)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """PyTorch's private knob, accepted so that code calling it runs: on CUDA
        PyTorch then allocates its pre-forward / pre-backward all-gathers on
        the default stream (and needs explicit prefetching for overlap).
        shardwise issues every gather as async work on one stream already, so
        the setting is recorded and changes nothing. (This module and every
        module below it, as in PyTorch.)"""
        for group in self._groups(recurse=True):
            group.settings.unshard_async_op = bool(async_op)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: whether the next backward is the last
        before the optimizer step. shardwise ends every backward with all
        gradients reduced and installed (its collectives are async work, with
        no streams to wait on at the last one), so this changes nothing."""

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit forward prefetch: these modules' all-gathers are issued right
        after this module's own, in pre-forward. Replaces the implicit order."""
        _set_prefetch(self, modules, "forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit backward prefetch: these modules' all-gathers are issued right
        after this module's own, in pre-backward. Replaces the implicit order."""
        _set_prefetch(self, modules, "backward_prefetch")

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the
        data-parallel size (this module only, not the ones below it); ``None``
        restores the default, as under PyTorch."""
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise ConfigError(f"gradient divide factor must be a positive number or None, got {factor!r}.")
        for group in self._groups(recurse=False):  # this module only, as PyTorch
            group.settings.gradient_divide_factor = None if factor is None else float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float | None) -> None:
        """Old name of :meth:`set_gradient_divide_factor` (warns, as PyTorch does)."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
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
            group.settings.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reduce-scatters may be in flight while backward goes
        on (the memory <-> overlap dial). (Default: ``1``; by default, small
        groups' reduce-scatters over gloo stay in flight up to 1 MiB of
        gathered parameters' worth, over two ranks held back to travel with
        the next prefetch; once this is set they keep to it.)

        Args:
            max_input_buffers: at least 1.
            recurse: also for every FSDP module below. (Default: ``True``)
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        # One queue of reductions under the root: the bound is the root's (the
        # states below share its context after the first forward).
        states = states_under(self) if recurse else [self._get_fsdp_state()]  # type: ignore[arg-type]
        for state in states:
            state.ctx.max_pending = max_input_buffers  # small groups' prefetch runs keep to it too

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
        custom one to choose the allocator. Warns when enabled. As PyTorch's,
        refused (either way) where a custom one is installed: it allocates."""
        for group in self._groups(recurse=False):
            for kind, comm in (("all gather", group.settings.all_gather_comm),
                               ("reduce scatter", group.settings.reduce_scatter_comm)):
                if not is_default(comm):
                    raise CustomCommError(
                        f"cannot call set_allocate_memory_from_process_group() when {kind} comm is custom: "
                        f"{type(comm).__name__} (its allocate() gives the buffers; drop the call, or "
                        "allocate from the process group in it)"
                    )
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
        self, hook: Callable[[torch.Tensor], None] | None, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``hook`` on the reduced gradient buffer (after the reduce-scatter,
        or after HSDP's all-reduce) in place, before gradients are installed —
        e.g. to all-reduce over another mesh dimension; ``None`` removes it, as
        under PyTorch. ``stream`` is accepted for compatibility; the hook runs
        on the current stream."""
        if hook is not None and not callable(hook):
            raise ConfigTypeError(f"set_all_reduce_hook expects a callable or None, got {type(hook).__name__}.")
        groups = list(self._groups(recurse=False))
        if len(groups) > 1:
            raise ConfigError(
                "set_all_reduce_hook is not supported with multiple param groups (from per-param mesh "
                f"via shard_placement_fn): {self._get_fsdp_state().name} has {len(groups)}, and the hook "
                "would be ambiguous across their meshes. Set it on a module whose parameters share one mesh."
            )
        if stream is not None and any(g.info.replicate_group is not None for g in groups):
            raise ConfigError(
                "stream cannot be set when using native HSDP: the hook runs where the HSDP all-reduce "
                "does. Call set_all_reduce_hook(hook) without stream."
            )
        for group in groups:
            group.settings.all_reduce_hook = hook

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event recorded after the optimizer step: the next all-gathers wait on
        it instead of the whole stream (CUDA; harmless elsewhere)."""
        self._get_fsdp_state().ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Take over how this module's all-gathers allocate and communicate."""
        if not accepts_as(comm, AllGather):
            raise ConfigTypeError(
                f"set_custom_all_gather expects an AllGather (a shardwise.AllGather, or any object with "
                f"allocate(size, *, dtype, device) and __call__(output_tensor, input_tensor, group, "
                f"async_op=False)), got {type(comm).__name__}."
            )
        for group in self._groups(recurse=False):
            group.settings.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Take over how this module's reduce-scatters allocate and communicate."""
        if not accepts_as(comm, ReduceScatter):
            raise ConfigTypeError(
                f"set_custom_reduce_scatter expects a ReduceScatter (a shardwise.ReduceScatter, or any object "
                f"with allocate(size, *, dtype, device) and __call__(output_tensor, input_tensor, group, op, "
                f"async_op=False)), got {type(comm).__name__}."
            )
        for group in self._groups(recurse=False):
            group.settings.reduce_scatter_comm = comm

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, call on the root: waits for
        collectives, reshards, and drops this iteration's trackers and pending
        gradients."""
        self._get_fsdp_state().reset_iter_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            "(A fully_shard-ed module cannot be deep-copied: its shards, hooks and collectives "
            "are tied to this instance; copy the model before sharding, or save and load its "
            "state dict.)"
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Convert the shards, not a temporary full copy (e.g. the root's after forward).
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for state in states_under(self):  # type: ignore[arg-type]
            for group in state.groups:
                group.reset_sharded_params()
        return out


# Every public method runs outside any graph torch.compile traces ([Note: hooks
# outside the traced region]): user code calls unshard(), reshard() or the
# setters inside compiled functions, and PyTorch's, in a file dynamo skips,
# are never traced either.
for _name, _method in list(vars(FSDPModule).items()):
    if not _name.startswith("_") and isinstance(_method, types.FunctionType):
        _disabled = dynamo_disable(_method)
        _disabled.__set_name__(FSDPModule, _name)
        setattr(FSDPModule, _name, _disabled)
del _name, _method, _disabled


def _set_prefetch(module: FSDPModule, modules: list[FSDPModule], attr: str) -> None:
    if not isinstance(modules, (list, tuple)):
        raise ConfigTypeError(f"expected a list of FSDPModules, got {type(modules).__name__}.")
    groups = []
    for m in modules:
        if not isinstance(m, FSDPModule):  # PyTorch's words first: code matches on them
            raise ConfigError(f"Expects FSDPModule but got {type(m)}: {m} (apply fully_shard to it first)")
        groups.extend(m._get_fsdp_state().groups)
    for group in module._get_fsdp_state().groups:
        setattr(group.settings, attr, groups)


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
        raise ConfigError(
            f"{type(module)} does not have a method {method_name}: register_fsdp_forward_method's "
            f"method_name={method_name!r} must name a method of the module."
        )
    orig = getattr(module, method_name)
    state = module._get_fsdp_state()

    @functools.wraps(orig)
    def wrapped(self: FSDPModule, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.method_pre_forward(args, kwargs)
        return state.method_post_forward(orig(*args, **kwargs))

    # Dynamo skips this frame but traces the method itself (PyTorch's wrapper is
    # in a file dynamo skips): compiled, the method breaks only at the hooks.
    # Bound, as PyTorch binds it (inspect.ismethod, __self__).
    import torch._dynamo

    skipped = torch._dynamo.disable(wrapped, recursive=False)  # type: ignore[no-untyped-call]
    setattr(module, method_name, types.MethodType(skipped, module))


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
    groups = [g for s in states for g in s.groups]
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
            optimizer state on the CPU; ``None`` is ``OffloadPolicy()``, as
            with PyTorch. (Default: ``OffloadPolicy()``: none)
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
    mp_policy, offload_policy = as_policy(mp_policy), as_policy(offload_policy)  # PyTorch's own, as ours
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ConfigTypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}.")
    if offload_policy is None:  # PyTorch takes None as no offloading
        offload_policy = OffloadPolicy()
    if not isinstance(offload_policy, OffloadPolicy):
        raise ConfigTypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}.")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ConfigError(
            "reshard_after_forward should be a bool, None, or an int giving the group size to "
            f"reshard to after forward, not {reshard_after_forward!r}."
        )
    state = shard_modules(
        modules,
        mesh=mesh if mesh is not None else default_mesh(),
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    state.fully_shard_rules = True  # PyTorch's fully_shard's, not FSDP1's ([Note: walking forward containers])
    for m in modules:
        cls = type(m)
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _FSDP_CLASSES[cls] = fsdp_cls
        m.__class__ = fsdp_cls
    return module


def _check_modules(module: Any) -> tuple[nn.Module, ...]:
    """The modules ``fully_shard`` manages: as PyTorch's, of a list only those
    with no ancestor in it (a listed module inside another listed one is
    already managed by that one, and stays as it is)."""
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ConfigError("fully_shard got an empty list of modules; pass at least one nn.Module.")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ConfigTypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}.")
    if len(modules) > 1:
        under = {id(m): {id(sub) for sub in m.modules()} for m in modules}
        modules = tuple(m for m in modules if not any(m is not o and id(m) in under[id(o)] for o in modules))
    seen: set[int] = set()
    for m in modules:
        if state_of(m) is not None or id(m) in seen:
            raise AlreadyShardedError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard has already been applied to this {type(m).__name__}; apply it once per "
                "module (to group several modules, pass them together as a list, each once)."
            )
        seen.add(id(m))
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ConfigError(
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__} "
                "(containers without forward); "
                "apply it to the modules inside, or pass them as a list: fully_shard(list(container))."
            )
    return modules


def _fully_shard_state(module: nn.Module) -> ModuleState | None:
    """``fully_shard.state(module)``, as PyTorch's (set by its ``contract``):
    the state shared by the modules of one ``fully_shard`` call, or ``None``
    for a module that was not passed to ``fully_shard``."""
    return state_of(module)


setattr(fully_shard, "state", _fully_shard_state)  # noqa: B010 (an attribute of a function, as PyTorch's)
