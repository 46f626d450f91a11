"""``FullyShardedDataParallel``: PyTorch's wrapper API (FSDP1) on shardwise's
one engine.

The wrapper translates, it does not re-implement (SPEC §3): the sharding
strategy becomes a mesh and a ``reshard_after_forward`` (see [Note: strategy
table] in ``strategies.py``), the auto-wrap policy decides which submodules
get a nested wrapper, and each wrapper calls ``fully_shard`` on its wrapped
module and configures the resulting engine group (prefetching, low-precision
gradients, a communication hook). Everything that runs during training is the
engine's.

Names: the wrapped module sits under ``_fsdp_wrapped_module`` (PyTorch's
attribute), but ``named_parameters()``, ``named_buffers()`` and every state
dict use the original names. The parameters are always the original ones, as
sharded ``DTensor`` s (PyTorch's ``use_orig_params=True`` behaviour, whatever
``use_orig_params`` says): there are no flat parameters.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise._engine.module_state import dynamo_disable, state_of
from shardwise._engine.param_group import ParamGroup, check_trainable_dtypes
from shardwise._engine.setup import shard_modules
from shardwise._engine.trees import cast_floats, map_tensors
from shardwise.errors import CommHookError, ConfigError, ConfigTypeError, UsageError
from shardwise.policies import CPUOffloadPolicy, OffloadPolicy
from shardwise.wrap import check_not_sharded, check_policy, plan_wrapping, post_order

from . import optim_state
from .comm_hooks import CommHookAllReduce, CommHookReduceScatter
from .config import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    from_pytorch,
)
from .managed import (
    CHECKPOINT_WRAPPED,
    WRAPPED_MODULE,
    is_wrapper,
    materialize_meta,
    move_to_device,
    own_tensors,
    resolve_ignored,
)
from .managed import sync_module_states as broadcast_module_states
from .mixed_precision import mark_full_precision_modules, to_mp_policy
from .state_dict import (
    clean_fqn,
    clean_name,
    get_state_dict_type,
    register_state_dict_hooks,
    root_wrappers,
    set_state_dict_type,
)
from .strategies import (
    HYBRID_STRATEGIES,
    StrategyPlan,
    check_strategy,
    default_device_type,
    resolve_strategy,
)
from .summon import summon

__all__ = ["FullyShardedDataParallel"]


def _check_optional(value: object, cls: type, arg: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise ConfigTypeError(f"{arg} must be a {cls.__name__} or None, got {value!r} ({type(value).__name__}).")


def _check_flag(value: object, arg: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{arg} must be a bool, got {value!r} ({type(value).__name__}).")
    return value


def _device_from_id(device_id: object) -> torch.device | None:
    if device_id is None:
        return None
    if isinstance(device_id, str):  # "cuda", "cpu", "cuda:1", as PyTorch takes them
        try:
            device_id = torch.device(device_id)
        except RuntimeError as e:
            raise ConfigError(f"device_id {device_id!r} is not a device: {e}") from None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise ConfigTypeError(
            f"device_id must be an int (a CUDA device index), a torch.device, a device string or None, "
            f"got {device_id!r}."
        )
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id.type == "cuda" and device_id.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device_id


def _wrappers_under(module: nn.Module) -> list[FullyShardedDataParallel]:
    """Every wrapper in ``module``'s subtree (``module`` included), in module order."""
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _shard_group_of(grad: torch.Tensor, fsdp_dims: int) -> dist.ProcessGroup | None:
    """The group a gradient is sharded over by its wrapper (the first of its
    wrapper's ``fsdp_dims`` mesh dimensions, of more than one rank, that
    shards it), or None: held whole here. The dimensions after them are
    tensor parallelism's, which FSDP1 does not reduce the norm over."""
    if isinstance(grad, DTensor):
        for i, pl in enumerate(grad.placements[:fsdp_dims]):
            if isinstance(pl, (Shard, _StridedShard)) and grad.device_mesh.size(i) > 1:
                return grad.device_mesh.get_group(i)
    return None


def _scale(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, cast: bool) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, the
    factor cast to each gradient's dtype (FSDP1's sharded clip) or not
    (``torch.nn.utils.clip_grad_norm_``'s)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype) if cast else coef.to(g.device))


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks
    (the API of PyTorch's FSDP1 ``FullyShardedDataParallel``).

    Example::

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    Args:
        module: the module to wrap.
        process_group: the group to shard over; for ``HYBRID_SHARD`` the pair
            ``(intra_node_group, inter_node_group)``. (Default: ``None``: the world)
        sharding_strategy: a :class:`ShardingStrategy`. (Default: ``None``: ``FULL_SHARD``)
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards, gradients
            and optimizer state on the CPU. (Default: ``None``: no offload)
        auto_wrap_policy: a policy from :mod:`shardwise.wrap` choosing the
            submodules that get their own nested wrapper. (Default: ``None``)
        backward_prefetch: a :class:`BackwardPrefetch` or ``None`` (no
            backward prefetch). (Default: ``BackwardPrefetch.BACKWARD_PRE``)
        mixed_precision: a :class:`MixedPrecision`. (Default: ``None``: full precision)
        ignored_modules: modules whose parameters stay unsharded and unmanaged.
            (Default: ``None``)
        param_init_fn: ``fn(module)`` materialising a meta-device module, called
            on each module the wrapper owns; without it, meta modules are
            allocated and ``reset_parameters()`` is called. (Default: ``None``)
        device_id: the compute device (an int is a CUDA index); the wrapped
            module's own tensors move there. (Default: ``None``: where they are,
            computing on the process group's device type)
        sync_module_states: broadcast rank 0's parameters and buffers before
            sharding, so a checkpoint loaded on rank 0 reaches every rank.
            (Default: ``False``)
        forward_prefetch: issue the next module's all-gather before the current
            forward computation (in the order recorded in the first iteration).
            (Default: ``False``)
        limit_all_gathers: bound the unsharded groups held at once. The wrapper
            always does (the current group plus one prefetched; ``fully_shard``
            prefetches small groups in runs), so ``False`` changes nothing and
            warns. (Default: ``True``)
        use_orig_params: accepted for compatibility; parameters are always the
            original ones, as sharded ``DTensor`` s. (Default: ``False``)
        ignored_states: ignored parameters or modules (instead of
            ``ignored_modules``). (Default: ``None``)
        device_mesh: a 1-D mesh to shard over, or for hybrid strategies a 2-D
            ``(replicate, shard)`` mesh. (Default: ``None``)
    """

    _fsdp_unit: nn.Module

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigTypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}.")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(  # FSDP1's words, for any container (refused below if it would lose parameters)
                f"FSDP will not all-gather parameters for containers that do not implement forward: {module}",
                stacklevel=2,
            )
        if is_wrapper(module) and auto_wrap_policy is not None:
            raise ConfigError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{type(module).__name__} already wrapped; wrap it once (with the policy) instead."
            )
        if state_of(module) is not None:  # a wrapper may wrap a wrapper (as FSDP1's may), not a fully_shard module
            raise ConfigError(
                f"this {type(module).__name__} is already sharded; wrap each module once (nested "
                "wrapping goes inside out, or let auto_wrap_policy do it)."
            )
        if (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward
                and auto_wrap_policy is None  # (with a policy its children may be wrapped and called, as in FSDP1)
                and _params_outside_wrappers(module)):  # (a policy's nested container of wrappers manages none)
            raise ConfigError(
                f"FullyShardedDataParallel cannot wrap a {type(module).__name__}: it has no forward, so "
                "its parameters would never be gathered. Wrap the modules inside it, or its parent."
            )
        # PyTorch's own enum members and configs are taken as ours
        sharding_strategy = from_pytorch(sharding_strategy)
        cpu_offload = from_pytorch(cpu_offload)
        backward_prefetch = from_pytorch(backward_prefetch)
        mixed_precision = from_pytorch(mixed_precision)
        strategy = check_strategy(sharding_strategy)
        _check_optional(cpu_offload, CPUOffload, "cpu_offload")
        _check_optional(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        _check_optional(mixed_precision, MixedPrecision, "mixed_precision")
        for value, arg in (
            (sync_module_states, "sync_module_states"),
            (forward_prefetch, "forward_prefetch"),
            (limit_all_gathers, "limit_all_gathers"),
            (use_orig_params, "use_orig_params"),
        ):
            _check_flag(value, arg)
        if not limit_all_gathers:
            warnings.warn(
                "limit_all_gathers=False has no effect in shardwise: the wrapper never holds more "
                "than the current and one prefetched group unsharded.",
                stacklevel=2,
            )
        if auto_wrap_policy is not None:
            check_policy(auto_wrap_policy, "auto_wrap_policy")
        device = _device_from_id(device_id)
        ignored = resolve_ignored(module, ignored_modules, ignored_states)
        auto_wrap = auto_wrap_policy is not None
        plan = resolve_strategy(strategy, process_group, device_mesh, default_device_type(device), auto_wrap)
        if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and plan.shard_group.size() == 1:
            # As FSDP1: one rank has nothing to shard (its words). (FSDP1 also
            # does this for the hybrid strategies with one rank per node, and
            # then reduces over that one rank alone: not copied.)
            warnings.warn(
                f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
                stacklevel=2,
            )
            strategy = ShardingStrategy.NO_SHARD
            plan = resolve_strategy(strategy, process_group, device_mesh, default_device_type(device), auto_wrap)
        if strategy == ShardingStrategy.NO_SHARD and dist.get_world_size(plan.replicate_group or plan.shard_group) > 1:
            warnings.warn(  # PyTorch's words
                "The `NO_SHARD` sharding strategy is deprecated. If having issues, "
                "please use `DistributedDataParallel` instead.",
                FutureWarning,
                stacklevel=2,
            )

        if auto_wrap_policy is not None:
            root_kwargs: dict[str, Any] = {
                "process_group": process_group,
                "sharding_strategy": sharding_strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                "param_init_fn": param_init_fn,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
                "ignored_states": ignored.params or None,
                # The hybrid groups this wrapper found, for its nested ones (as FSDP1).
                "device_mesh": plan.mesh if strategy in HYBRID_STRATEGIES and process_group is None and device_mesh is None
                else device_mesh,
            }
            self._auto_wrap(module, auto_wrap_policy, root_kwargs, ignored, mixed_precision)
            if device_mesh is None:  # FSDP1 hands the groups it built to nested wrappers, with no mesh
                for nested in module.modules():
                    if is_wrapper(nested):
                        nested.__dict__["_device_mesh"] = None

        compute_device = device or (
            torch.device("cuda", torch.cuda.current_device()) if plan.mesh.device_type == "cuda" else torch.device("cpu")
        )
        materialize_meta(module, ignored, param_init_fn, compute_device)
        if device is not None:
            move_to_device(module, ignored, device)
        if sync_module_states:
            broadcast_module_states(module, ignored, plan.mesh)

        offload = cpu_offload is not None and cpu_offload.offload_params
        # As PyTorch's wrapper (at construction, unlike fully_shard's first
        # forward): this unit's own trainable parameters share one dtype.
        check_trainable_dtypes(
            [
                (p.dtype, n) for n, p in module.named_parameters()
                if p.requires_grad and not isinstance(p, DTensor) and p not in ignored.params
            ],
            to_mp_policy(mixed_precision),
        )
        # The engine's one way in, as fully_shard's; the wrapped module keeps
        # the user's class (type(), repr), as with PyTorch's wrapper.
        shard_modules(
            (module,),
            mesh=plan.mesh,
            reshard_after_forward=plan.reshard_after_forward,
            shard_placement_fn=None,
            mp_policy=to_mp_policy(mixed_precision),
            offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
            ignored_params=ignored.params,
            spec_mesh=plan.spec_mesh,
        )
        self._fsdp_wrapped_module = module
        # As FSDP1: a parameter the unit holds in several places is registered
        # again at every place after its first, so there it comes after its
        # module's other parameters (state dicts list a tied head's weight
        # after its bias).
        unit = state_of(module)
        for group in unit.groups if unit is not None else ():
            for sp in group.params:
                for owner, name in sp.owners[1:]:
                    owner._parameters[name] = owner._parameters.pop(name)
        # The module sharded, kept outside _modules: what sits under
        # _fsdp_wrapped_module may be replaced (apply_activation_checkpointing
        # after wrapping puts a CheckpointWrapper there), the engine state stays here.
        self.__dict__["_fsdp_unit"] = module
        self._plan: StrategyPlan = plan
        self._device_mesh = device_mesh  # FSDP1's: the mesh the user passed (LOCAL_STATE_DICT refuses one)
        if strategy in HYBRID_STRATEGIES:
            self._inter_node_pg = plan.replicate_group  # FSDP1's name for it
        self._ignored = ignored
        self._compute_device = compute_device
        self._mixed_precision = mixed_precision
        self._cpu_offload = cpu_offload or CPUOffload()
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._limit_all_gathers = limit_all_gathers
        self._use_orig_params = use_orig_params
        self._buffers_cast = False
        # Own buffers' dtypes before MixedPrecision.buffer_dtype (name -> dtype).
        self._buffer_dtypes: dict[str, torch.dtype] = {}
        self._comm_hook: Callable[..., Any] | None = None
        self._comm_hook_state: object = None
        self._state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        self._configure_group()
        register_state_dict_hooks(self)

    # ---- construction helpers -------------------------------------------------------
    def _auto_wrap(
        self,
        module: nn.Module,
        policy: Any,
        root_kwargs: dict[str, Any],
        ignored: Any,
        mixed_precision: MixedPrecision | None,
    ) -> None:
        """Replace the submodules ``policy`` selects with nested wrappers, inner first."""
        check_not_sharded(module, "auto_wrap_policy")
        also = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
        plan = plan_wrapping(
            module,
            policy,
            root_kwargs=root_kwargs,
            ignored_modules=ignored.modules,
            ignored_params=ignored.params,
            also_wrap=also,
            also_wrap_kwargs={"mixed_precision": None},
        )
        if also:
            found = mark_full_precision_modules(module, also, ignored.modules)
            if found:
                warnings.warn(  # FSDP1's words, its misspelling included (its tests match them)
                    "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
                    f"module has submodules of type:\n{set(found)}\nThese modules will be wrapped as separate "
                    "FSDP instacnes with mixed precision disabled. (MixedPrecision._module_classes_to_ignore: "
                    "they run in full precision.)",
                    stacklevel=3,
                )
        for parent, name, m in list(post_order(module)):
            kwargs = plan.get(m)
            if kwargs is None or parent is None:
                continue
            kwargs = {k: v for k, v in kwargs.items() if k != "auto_wrap_policy"}
            try:
                wrapped = type(self)(m, **kwargs)
            except TypeError as exc:
                if "unexpected keyword argument" not in str(exc):
                    raise
                raise ConfigTypeError(
                    f"auto_wrap_policy gave {type(m).__name__} an argument FullyShardedDataParallel does "
                    f"not take ({exc}); a CustomPolicy's dict may hold only constructor arguments."
                ) from exc
            setattr(parent, name, wrapped)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``.to()``, ``to_empty()`` and friends convert the shards, not a
        temporary full copy, and the engine re-adopts what they replaced."""
        group = self._group
        if group is not None:
            group.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[no-untyped-call]
        if group is not None:
            group.reset_sharded_params()
        return out

    def _configure_group(self) -> None:
        """Translate the prefetch and precision options into engine group settings."""
        group = self._group
        if group is None:
            return
        settings = group.settings
        # [Note: prefetch order] in the engine: None is the implicit order, [] none.
        settings.forward_prefetch = None if self._forward_prefetch else []
        settings.register_sharded_when_idle = True
        settings.prefetch_runs = False  # limit_all_gathers: the current group plus one prefetched
        if self._backward_prefetch is None:
            settings.backward_prefetch = []
        else:
            settings.backward_prefetch = None
            settings.prefetch_in_post_backward = self._backward_prefetch == BackwardPrefetch.BACKWARD_POST
        mp = self._mixed_precision
        settings.keep_low_precision_grads = bool(mp is not None and mp.keep_low_precision_grads)
        # FSDP1 reduces a unit's whole flat gradient: a trainable parameter the
        # forward did not use gets zeros (so the optimizer steps it) whenever
        # any parameter of its unit got a gradient.
        settings.reduce_scatter_unused_params = True
        # FSDP1's division around the sum, and its accumulation in no_sync.
        settings.fsdp1_divide = True
        settings.accumulate_in_reduce_dtype = False
        settings.refuse_grad_of_grad = True
        settings.step_in_backward_optimizers = True

    # ---- plain accessors ---------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpointing wrapper put
        around it after wrapping, the module it checkpoints, as PyTorch's)."""
        inner = self._fsdp_wrapped_module
        return inner._modules.get(CHECKPOINT_WRAPPED) or inner

    @property
    def _group(self) -> ParamGroup | None:
        state = state_of(self._fsdp_unit)
        return state.group if state is not None else None

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The sharding strategy of this wrapper."""
        return self._plan.strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        """This wrapper's mixed precision (``MixedPrecision()`` when none)."""
        return self._mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        """This wrapper's CPU offload setting."""
        return self._cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        """This wrapper's backward prefetch mode."""
        return self._backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """Whether this wrapper prefetches in forward."""
        return self._forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """The ``limit_all_gathers`` argument (the engine always limits)."""
        return self._limit_all_gathers

    # FSDP1's per-wrapper fields for the state-dict settings (its tests read them)
    @property
    def _state_dict_type(self) -> StateDictType:
        return self._state_dict_settings.state_dict_type

    @property
    def _state_dict_config(self) -> Any:
        return self._state_dict_settings.state_dict_config

    @property
    def _optim_state_dict_config(self) -> Any:
        return self._state_dict_settings.optim_state_dict_config

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group parameters are sharded over (for hybrid strategies, the
        intra-node group; for ``NO_SHARD``, as in PyTorch, all the ranks that
        replicate the model)."""
        if self._plan.strategy == ShardingStrategy.NO_SHARD and self._plan.replicate_group is not None:
            return self._plan.replicate_group
        return self._plan.shard_group

    @property
    def rank(self) -> int:
        """This rank's index in :attr:`process_group`."""
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""
        return dist.get_world_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        """Where forward and backward run."""
        return self._compute_device

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get(WRAPPED_MODULE)
            if name == WRAPPED_MODULE or inner is None:  # not built yet (e.g. mid-deepcopy)
                raise
            return getattr(inner, name)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing (e.g. into an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's hook for wrappers: every
        name under this one is reached through ``_fsdp_wrapped_module``, which
        the fully qualified names skip (as they do for PyTorch's FSDP1), so
        ``get_state_dict`` / ``set_state_dict`` keys are the original names.
        The wrapped module's own parameters and buffers are listed too: a
        wrapper around a leaf (an ``nn.Linear``) has no children, and those
        APIs skip the segment only for a name listed here."""
        inner = self._fsdp_wrapped_module
        names = [n for n, _ in inner.named_children()]
        names += [n for n, _ in inner.named_parameters(recurse=False)]
        names += [n for n, _ in inner.named_buffers(recurse=False)]
        return dict.fromkeys(names, "_fsdp_wrapped_module")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters`` with the original names (no
        ``_fsdp_wrapped_module.`` segments)."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_name(name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers`` with the original names."""
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_name(name), b

    # ---- forward ---------------------------------------------------------------------
    @property
    def _is_root(self) -> bool | None:
        """The engine's answer: whether this wrapper's module state is the root
        (``None`` until the first forward, or :meth:`check_is_root`, decides)."""
        state = state_of(self._fsdp_unit)
        return state.is_root if state is not None else None

    @dynamo_disable  # outside a compiled forward's graph, as FSDP1's (a file dynamo skips)
    def _lazy_init(self) -> None:
        """At the first forward: the engine makes the outermost wrapper's state
        the root (one root for both fronts), and every wrapper under it casts its
        own buffers to its ``buffer_dtype``."""
        if self._buffers_cast:
            return
        wrappers = _wrappers_under(self)
        for attr, name in (("_use_orig_params", "_use_orig_params"), ("_limit_all_gathers", "limit_all_gathers")):
            values = {getattr(w, attr) for w in wrappers}
            if len(values) > 1:  # as FSDP1 at its root's first forward
                raise ConfigError(
                    f"Expects one homogeneous value for {name} but got {values}: pass the same "
                    f"{name.lstrip('_')} to every FullyShardedDataParallel of one model."
                )
        if any(not w._use_orig_params for w in wrappers) and any(
            hasattr(p, "_in_backward_optimizers") for p in self.parameters()
        ):
            raise UsageError(  # RuntimeError too, as FSDP1's (at its root's first forward)
                "FSDP optimizer in backward only supported with use_orig_params=True! "
                "(_apply_optimizer_in_backward needs FullyShardedDataParallel(..., use_orig_params=True).)"
            )
        state = state_of(self._fsdp_unit)
        if state is not None:
            state.lazy_init()
        for w in wrappers:
            if not w._buffers_cast:
                w._cast_buffers()
                w._buffers_cast = True

    def _cast_buffers(self) -> None:
        mp = self._mixed_precision
        if mp is None or mp.buffer_dtype is None:
            return
        for t in own_tensors(self._fsdp_unit, self._ignored, persistent_only=False):
            if t.is_param:
                continue
            buf = t.module._buffers[t.attr]
            if buf is None or not buf.is_floating_point() or buf.dtype == mp.buffer_dtype:
                continue
            self._buffer_dtypes.setdefault(clean_fqn(t.name), buf.dtype)
            t.module._buffers[t.attr] = buf.to(mp.buffer_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; a wrapper with parameters of its own casts
        inputs to ``param_dtype`` if ``cast_forward_inputs``, the root also if
        ``cast_root_forward_inputs``, as FSDP1 does (its root pre-forward
        casts, then every wrapper's pre-forward that has a flat parameter,
        the root's included; its documentation says only that the root's
        setting takes precedence)."""
        if not self._buffers_cast:  # (a traced forward then never calls the disabled _lazy_init again)
            self._lazy_init()
        mp = self._mixed_precision
        cast = mp is not None and (
            bool(self._is_root and mp.cast_root_forward_inputs) or (mp.cast_forward_inputs and self._group is not None)
        )
        if mp is not None and mp.param_dtype is not None and cast:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            # FSDP1's post-forward rebuilds the outputs' containers as it
            # registers its pre-backward hooks ([Note: walking forward containers]);
            # not in a forward recomputed in backward, where it returns early.
            output = map_tensors(_same, output)
        return output

    def check_is_root(self) -> bool:
        """Whether this is the root wrapper (decided at the first forward, or now)."""
        self._lazy_init()
        return bool(self._is_root)

    # PyTorch's words for each (its tests match them), then ours.
    _NOT_ROOT = {
        "no_sync()": "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on root "
        "FSDP module.",
        "clip_grad_norm_()": "`clip_grad_norm_()` should only be called on the root FSDP instance",
        "register_comm_hook": "register_comm_hook can only be called on a root instance.",
    }

    def _require_root(self, what: str, error: type[UsageError] = UsageError, exact: bool = False) -> None:
        if not self.check_is_root():
            ours = "" if exact else (
                f" ({what} must be called on the root FullyShardedDataParallel module, the outermost one, "
                "not on a nested one.)"
            )
            raise error(self._NOT_ROOT[what] + ours)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every wrapper in ``module``'s subtree (``module`` included); with
        ``root_only``, only those not nested in another.

        Args:
            module: any module.
            root_only: only the outermost wrappers. (Default: ``False``)
        """
        return cast(list[FullyShardedDataParallel], root_wrappers(module) if root_only else _wrappers_under(module))

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this wrapper's full parameters gathered (and
        written back), so ``fn`` can initialise them."""
        uninitialized = self._is_root is None
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        state = state_of(self._fsdp_unit)
        if uninitialized and state is not None:
            state.reset_lazy_init()  # as FSDP1: a child wrapped before its parent is no root
        return self

    # ---- training helpers ----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication inside the context; they
        are reduced at the first backward after it. Call it on the root.
        ``SHARD_GRAD_OP`` also keeps its gathered parameters across backward."""
        self._require_root("no_sync()")
        saved = []
        for w in _wrappers_under(self):
            group = w._group
            if group is None:
                continue
            settings = group.settings
            saved.append((settings, settings.requires_grad_sync, settings.reshard_after_backward))
            settings.requires_grad_sync = False
            if w._plan.keep_params_in_no_sync:
                settings.reshard_after_backward = False
        try:
            yield
        finally:
            for settings, sync, reshard in saved:
                settings.requires_grad_sync = sync
                settings.reshard_after_backward = reshard

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all parameters in place so that their total
        norm (over every shard on every rank, viewed as one vector) is at most
        ``max_norm``; return that total norm. Call it on the root, on every rank.

        Args:
            max_norm: the largest allowed norm.
            norm_type: the p of the p-norm; ``math.inf`` for the max norm. (Default: ``2.0``)
        """
        self._require_root("clip_grad_norm_()")
        wrappers = [w for w in _wrappers_under(self) if w._group is not None]
        # FSDP1's order: wrappers in module order, a wrapper's own parameters
        # in module order (its flat parameter's), then those no wrapper manages.
        managed = self._managed_in_order(wrappers)
        if all(w._plan.strategy == ShardingStrategy.NO_SHARD for w in wrappers):
            # As FSDP1: nothing sharded, so PyTorch's own clip over its
            # parameters' gradients (each rank holds them whole): the original
            # ones, or with use_orig_params=False each unit's flat gradient.
            grads = [_local(g) for q in self.parameters() if (g := q.grad) is not None]
            norm_of = grads if self._use_orig_params else self._flat_grads(managed)
            total = torch.nn.utils.get_total_norm(norm_of, norm_type)
            _scale(grads, max_norm, total, cast=False)
            return total
        max_norm, p = float(max_norm), float(norm_type)
        device = self._compute_device
        inf = math.isinf(p)
        # FSDP1's arithmetic: sharded gradients' norms combined over the shard
        # group, the rest (NO_SHARD units', those no wrapper manages)
        # locally. A gradient's norm is taken in fp32, a list's as the norm
        # of its norms.
        sharded: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {
            id(self._plan.shard_group): (self._plan.shard_group, [])
        }
        local: list[torch.Tensor] = []
        for g, fsdp_dims in ((q.grad, w._plan.mesh.ndim) for w, unit in zip(wrappers, managed) for q in unit):
            if g is None or not _local(g).numel():
                continue  # (no elements here: FSDP1 shows no gradient)
            norm = torch.linalg.vector_norm(_local(g).detach(), p, dtype=torch.float32)
            group = _shard_group_of(g, fsdp_dims)
            if group is None:
                local.append(norm)
            else:
                sharded.setdefault(id(group), (group, []))[1].append(norm)
        local += [
            torch.linalg.vector_norm(_local(g).detach(), p, dtype=torch.float32)
            for g in self._unmanaged_grads(managed)
        ]
        grads = [g for q in self.parameters() if (g := q.grad) is not None]
        total = torch.zeros((), device=device)
        for i, (group, norms) in enumerate(sharded.values()):
            if norms:
                part = torch.linalg.vector_norm(torch.stack(norms), p, dtype=torch.float32).to(device)
            else:
                part = torch.zeros((), device=device)
            part = part if inf else part**p
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
            total = part if i == 0 else torch.maximum(total, part) if inf else total + part
        if local:
            part = torch.linalg.vector_norm(torch.stack(local), p, dtype=torch.float32).to(device)
            total = torch.maximum(total, part) if inf else total + part**p
        if inf:
            # Gradients no wrapper reduces (ignored modules') differ between
            # ranks: the max over the process group, as FSDP1 takes, so every
            # rank clips alike. (A p-norm adds them locally, as FSDP1 does.)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self._plan.shard_group)
        else:
            total = total ** (1.0 / p)
        if self._cpu_offload.offload_params:
            total = total.cpu()
        _scale([_local(g) for g in grads], max_norm, total, cast=True)
        if not grads:
            warnings.warn(
                f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                f"the total norm in the default dtype {total.dtype}",
                stacklevel=2,
            )
            return total
        return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))

    def _managed_in_order(self, wrappers: list[FullyShardedDataParallel]) -> list[list[nn.Parameter]]:
        """Each wrapper's parameters (sharded), in module order as FSDP1's flat
        parameter holds them."""
        order = {id(q): i for i, q in enumerate(self.parameters())}
        return [
            sorted((sp.sharded_param for sp in w._group.params), key=lambda q: order.get(id(q), -1))
            for w in wrappers if w._group is not None
        ]

    def _flat_grads(self, managed: list[list[nn.Parameter]]) -> list[torch.Tensor]:
        """The gradients FSDP1's parameters would have with use_orig_params=False:
        each unit's flat gradient (its parameters' as one vector), then those
        of parameters no unit manages."""
        flat = [
            torch.cat(parts) for unit in managed
            if (parts := [_local(g).reshape(-1) for q in unit if (g := q.grad) is not None])
        ]
        return flat + [_local(g) for g in self._unmanaged_grads(managed)]

    def _unmanaged_grads(self, managed: list[list[nn.Parameter]]) -> list[torch.Tensor]:
        """Gradients of the parameters no wrapper manages (ignored modules'), in module order."""
        ids = {id(q) for unit in managed for q in unit}
        return [g for q in self.parameters() if id(q) not in ids and (g := q.grad) is not None]

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Reduce gradients with ``hook(state, grad, output)`` instead of the
        default reduce-scatter, on every wrapper under this root (before the
        first forward, once). ``grad`` is the flat unsharded gradient,
        ``output`` this rank's shard; the hook averages. Sharded strategies
        (``FULL_SHARD``, ``SHARD_GRAD_OP``) only.

        Args:
            state: passed to every call of ``hook`` (e.g.
                ``default_hooks.DefaultState(model.process_group)``).
            hook: e.g. ``default_hooks.reduce_scatter_hook``,
                ``fp16_compress_hook`` or ``bf16_compress_hook``.
        """
        # FSDP1's words and exception types throughout: its tests match two of
        # these messages whole (anchored), so nothing of ours follows them.
        self._require_root("register_comm_hook", CommHookError, exact=True)
        wrappers = _wrappers_under(self)
        for w in wrappers:
            if w._plan.strategy in HYBRID_STRATEGIES:
                raise CommHookError(
                    f"Communication hook is not supported for hybrid strategies: {w._plan.strategy} "
                    "(use FULL_SHARD or SHARD_GRAD_OP)."
                )
            if w._comm_hook is not None:
                raise CommHookError("A communication hook is already registered")
            if not callable(hook):
                raise ConfigError(
                    f"The communication hook must be callable but got {hook!r}: pass a function "
                    "hook(state, grad, output), e.g. default_hooks.reduce_scatter_hook."
                )
        for w in wrappers:
            w._comm_hook = hook
            w._comm_hook_state = state
            group = w._group
            if group is not None:
                if w._plan.strategy == ShardingStrategy.NO_SHARD:
                    # hook(state, grad): the all-reduce across replicas (the
                    # reduce-scatter runs over a group of one: a copy)
                    group.settings.replicate_all_reduce = CommHookAllReduce(hook, state)
                else:
                    group.settings.reduce_scatter_comm = CommHookReduceScatter(hook, state)
                group.settings.gradient_divide_factor = 1.0  # the hook averages

    # ---- summon_full_params ------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Expose full, full-precision parameters of the wrappers in ``module``
        (outside forward and backward). On exit, changes to this rank's part are
        written back (``writeback``) and the parameters are sharded again.

        Args:
            module: a wrapper, or any module containing some.
            recurse: also the nested wrappers. (Default: ``True``)
            writeback: keep modifications. (Default: ``True``)
            rank0_only: only rank 0 holds full parameters; the others keep their
                shards. Not with ``writeback=True``. (Default: ``False``)
            offload_to_cpu: the full parameters are CPU copies. (Default: ``False``)
            with_grads: also gather gradients, as the full parameters' ``.grad``.
                (Default: ``False``)
        """
        for value, arg in (
            (recurse, "recurse"),
            (writeback, "writeback"),
            (rank0_only, "rank0_only"),
            (offload_to_cpu, "offload_to_cpu"),
            (with_grads, "with_grads"),
        ):
            _check_flag(value, arg)
        with summon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    # ---- state dicts -------------------------------------------------------------------
    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type (and model / optimizer configs) of every
        wrapper under ``module``; return the previous settings.

        Args:
            module: the root module (wrapper or not).
            state_dict_type: FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT.
            state_dict_config: the matching config. (Default: ``None``: its defaults)
            optim_state_dict_config: the matching optimizer config. (Default: ``None``)
        """
        warnings.warn(
            "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated. Please use APIs, "
            "get_state_dict() and set_state_dict(), which can support different parallelisms, FSDP1, FSDP2, DDP. "
            "API doc: https://pytorch.org/docs/stable/distributed.checkpoint.html"
            "#torch.distributed.checkpoint.state_dict.get_state_dict ."
            "Tutorial: https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html .",
            FutureWarning,
            stacklevel=2,
        )
        return set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
        """The state-dict settings of the wrappers under ``module`` (they must agree); None where there are none."""
        return get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """:meth:`set_state_dict_type` for the duration of the context."""
        # through the public method, so that PyTorch's FutureWarning is given as FSDP1 gives it
        prev = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            if prev.state_dict_type is not None:  # None: no wrapper under module, nothing was set
                FullyShardedDataParallel.set_state_dict_type(
                    module, prev.state_dict_type, prev.state_dict_config, prev.optim_state_dict_config
                )

    # ---- optimizer state dicts (see optim_state.py) -------------------------------------
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_state.rekey_optim_state_dict)


def _params_outside_wrappers(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters that no wrapper inside it manages."""
    inner = {id(p) for m in module.modules() if m is not module and is_wrapper(m) for p in m.parameters()}
    return any(id(p) not in inner for p in module.parameters())
