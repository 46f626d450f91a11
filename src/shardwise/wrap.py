"""Wrap policies: which submodules become their own sharding unit.

The same policies, with the same call signatures, as PyTorch's FSDP
``wrap`` module: the classes :class:`ModuleWrapPolicy` and
:class:`CustomPolicy`, and the functions :func:`transformer_auto_wrap_policy`,
:func:`size_based_auto_wrap_policy`, :func:`lambda_auto_wrap_policy` and
:func:`always_wrap_policy`, which are used through ``functools.partial``::

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})

They serve both fronts: ``FullyShardedDataParallel(model, auto_wrap_policy=policy)``
and :func:`apply_policy` (``fully_shard`` on every selected module, bottom-up,
then on the root), which PyTorch lacks.

[Note: two kinds of policy]
A policy *object* (:class:`Policy`) selects modules in one pass over
``root.modules()`` and may give each its own keyword arguments. A policy
*function* ``f(module, recurse, nonwrapped_numel) -> bool`` is asked twice per
module during a depth-first walk: with ``recurse=True`` whether to descend into
it, and, after its children, with ``recurse=False`` whether to wrap it given
the parameter count its wrapped children did not take. :func:`plan_wrapping`
turns either kind into one answer, {module: keyword arguments}, applied in
post-order so that children are wrapped before their parents.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from torch import nn

from shardwise._engine.module_state import state_of
from shardwise.errors import ConfigError, ConfigTypeError
from shardwise.fully_shard import FSDPModule, fully_shard

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "Policy",
    "always_wrap_policy",
    "apply_policy",
    "check_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "plan_wrapping",
    "post_order",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

PolicyFn = Callable[..., bool]
Plan = dict[nn.Module, dict[str, Any]]


class Policy(ABC):
    """A policy object: selects the modules to wrap and their keyword arguments."""

    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Plan:
        """Map each module to wrap (the root may be among them) to its kwargs."""


_Policy = Policy  # PyTorch's name for the base class


class ModuleWrapPolicy(Policy):
    """Wrap every module that is an instance of one of ``module_classes``, with
    the root's keyword arguments.

    Args:
        module_classes: the classes to wrap, e.g. ``{TransformerBlock}``.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = set(module_classes)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ConfigTypeError(
                    f"ModuleWrapPolicy takes nn.Module subclasses, got {cls!r}; pass e.g. {{MyBlock}}."
                )
        self._module_classes = classes
        self._module_classes_str = str(classes)

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Plan:
        classes = tuple(self._module_classes)
        return {
            m: copy.copy(root_kwargs)
            for m in root_module.modules()
            if m not in ignored_modules and isinstance(m, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """The same choice as a policy function (for ``_or_policy`` and friends)."""
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({self._module_classes_str})"


class CustomPolicy(Policy):
    """Wrap the modules for which ``lambda_fn(module)`` is ``True`` (root's
    keyword arguments) or a non-empty dict (the root's, overridden by it);
    ``False`` or ``{}`` leaves the module unwrapped.

    Args:
        lambda_fn: ``module -> bool | dict``.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise ConfigTypeError(f"CustomPolicy takes a callable, got {type(lambda_fn).__name__}.")
        self._lambda_fn = lambda_fn

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Plan:
        plan: Plan = {}
        for m in root_module.modules():
            if m in ignored_modules:
                continue
            res = self._lambda_fn(m)
            if not isinstance(res, (dict, bool)):
                raise ConfigTypeError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg "
                    f"dict, but it returned {res!r} for a {type(m).__name__}."
                )
            if not res:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(res, dict):
                kwargs.update(res)
            plan[m] = kwargs
        return plan


# ---- policy functions -----------------------------------------------------------
def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule."""
    return True


def _module_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes: Iterable[type[nn.Module]]
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap the submodules for which ``lambda_fn(module)`` is true.

    Args:
        module: the module considered.
        recurse: ``True`` while descending (always descend), ``False`` to decide.
        nonwrapped_numel: parameters not yet wrapped (unused).
        lambda_fn: ``module -> bool``.
    """
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (a set of classes).

    Args:
        module: the module considered.
        recurse: ``True`` while descending (always descend), ``False`` to decide.
        nonwrapped_numel: parameters not yet wrapped (unused).
        transformer_layer_cls: the layer classes to wrap.
    """
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once the parameters its wrapped children left reach
    ``min_num_params``.

    Args:
        module: the module considered.
        recurse: ``True`` while descending, ``False`` to decide.
        nonwrapped_numel: parameters under ``module`` not yet wrapped.
        min_num_params: the threshold, in elements. (Default: ``1e8``)
        force_leaf_modules: never descend into these classes. (Default:
            ``None``: ``{nn.MultiheadAttention}``)
        exclude_wrap_modules: never wrap these classes. (Default: ``None``:
            ``{nn.ModuleList, nn.ModuleDict}``)
    """
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules  # type: ignore[attr-defined]
    excluded = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules  # type: ignore[attr-defined]
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(leaves))
    return is_large and not isinstance(module, tuple(excluded))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[PolicyFn]) -> bool:
    """Wrap ``module`` if any of ``policies`` would."""
    return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for p in policies)


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Iterable[type], recurse: bool, *args: Any, **kwargs: Any
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


# ---- manual wrapping ------------------------------------------------------------------
class _WrapContext:
    """The wrapper class and arguments of the innermost ``enable_wrap`` block."""

    active: bool = False
    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012 (one context at a time, reset on exit)


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, :func:`wrap` wraps modules with ``wrapper_cls(module,
    **wrapper_kwargs)``, e.g. to shard large layers as they are built.

    Args:
        wrapper_cls: e.g. ``FullyShardedDataParallel``.
        **wrapper_kwargs: arguments for every wrapped module.
    """
    if _WrapContext.active:
        raise NotImplementedError("enable_wrap blocks do not nest; close the outer one first.")
    _WrapContext.active, _WrapContext.wrapper_cls, _WrapContext.kwargs = True, wrapper_cls, dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.active, _WrapContext.wrapper_cls, _WrapContext.kwargs = False, None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside :func:`enable_wrap` (its arguments, overridden
    by ``wrap_overrides``); outside, return it unchanged.

    Args:
        module: the module to wrap.
        **wrap_overrides: arguments that take priority over ``enable_wrap``'s.
    """
    if not _WrapContext.active or _WrapContext.wrapper_cls is None:
        return module
    return _WrapContext.wrapper_cls(module, **{**_WrapContext.kwargs, **wrap_overrides})


# ---- planning ---------------------------------------------------------------------
def post_order(root: nn.Module) -> Iterator[tuple[nn.Module | None, str, nn.Module]]:
    """``(parent, name, module)`` for every module under ``root`` in post-order
    (children before parents), each shared module once; the root comes last
    with parent ``None``."""
    visited: set[int] = {id(root)}

    def visit(module: nn.Module, name: str, parent: nn.Module | None) -> Iterator[tuple[nn.Module | None, str, nn.Module]]:
        for child_name, child in list(module.named_children()):
            if id(child) not in visited:
                visited.add(id(child))
                yield from visit(child, child_name, module)
        yield parent, name, module

    yield from visit(root, "", None)


def _runs_policy(policy: object) -> bool:
    """A policy object of PyTorch's own (its wrap module's
    ``CustomPolicy``, ``ModuleWrapPolicy``): the same ``_run_policy`` as ours."""
    return not isinstance(policy, Policy) and callable(getattr(policy, "_run_policy", None))


def check_policy(policy: object, arg: str) -> None:
    """Refuse anything but a policy object or a callable, naming ``arg``."""
    if not isinstance(policy, Policy) and not callable(policy) and not _runs_policy(policy):
        raise ConfigTypeError(
            f"{arg} must be a policy object (ModuleWrapPolicy, CustomPolicy) or a policy function "
            f"such as functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Block}}), "
            f"got {type(policy).__name__}."
        )


def plan_wrapping(
    root: nn.Module,
    policy: Policy | PolicyFn,
    *,
    root_kwargs: dict[str, Any] | None = None,
    ignored_modules: set[nn.Module] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    also_wrap: tuple[type[nn.Module], ...] = (),
    also_wrap_kwargs: dict[str, Any] | None = None,
) -> Plan:
    """The modules under ``root`` (never ``root`` itself) that ``policy``
    selects, each with its keyword arguments; see [Note: two kinds of policy].

    Args:
        root: the module whose submodules are considered.
        policy: a :class:`Policy` or a policy function.
        root_kwargs: the arguments every selected module starts from.
            (Default: ``None``: ``{}``)
        ignored_modules: neither wrapped nor descended into. (Default: ``None``)
        ignored_params: not counted by size-based policies. (Default: ``None``)
        also_wrap: classes wrapped on their own whatever the policy says (the
            wrapper's ``MixedPrecision._module_classes_to_ignore``). (Default: ``()``)
        also_wrap_kwargs: overrides for those. (Default: ``None``)
    """
    check_policy(policy, "policy")
    kwargs = dict(root_kwargs or {})
    ignored_m = ignored_modules or set()
    ignored_p = {id(p) for p in (ignored_params or ())}
    extra = tuple(also_wrap)
    if isinstance(policy, Policy) or _runs_policy(policy):
        plan = cast(Any, policy)._run_policy(root, ignored_m, kwargs)
        if not isinstance(plan, dict):
            raise ConfigTypeError(f"{type(policy).__name__}._run_policy must return a dict, got {type(plan).__name__}.")
        if extra:
            for m in root.modules():
                if m not in ignored_m and isinstance(m, extra):
                    plan[m] = {**plan.get(m, kwargs), **(also_wrap_kwargs or {})}
    else:
        fn: PolicyFn = policy
        if extra:
            fn = functools.partial(
                _or_policy,
                policies=[policy, functools.partial(_wrap_module_cls_individually, module_classes=extra)],
            )
        plan = {}

        def visit(module: nn.Module, only_children: bool) -> int:
            nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in ignored_p)
            if not fn(module=module, recurse=True, nonwrapped_numel=nonwrapped):
                return 0
            wrapped = 0
            for child in module.children():
                if child not in ignored_m:
                    wrapped += visit(child, False)
            if not only_children and fn(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped):
                own = dict(kwargs)
                if extra and isinstance(module, extra):
                    own.update(also_wrap_kwargs or {})
                plan[module] = own
                return nonwrapped
            return wrapped

        visit(root, True)
    plan.pop(root, None)
    return plan


def check_not_sharded(root: nn.Module, what: str) -> None:
    """Auto-wrapping needs a module tree that nothing has sharded yet."""
    for name, m in root.named_modules():
        if state_of(m) is not None or isinstance(m, FSDPModule):
            raise ConfigError(
                f"FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{name or 'the root'} in {type(root).__name__}: {what} needs modules that are not "
                f"sharded yet ({type(m).__name__} already is). Build the model afresh, or shard it by hand."
            )


_FULLY_SHARD_ARGS = frozenset(
    {"mesh", "reshard_after_forward", "shard_placement_fn", "mp_policy", "offload_policy", "ignored_params"}
)


def apply_policy(module: nn.Module, policy: Policy | PolicyFn, **fully_shard_kwargs: Any) -> FSDPModule:
    """Apply ``fully_shard`` to every submodule ``policy`` selects (children
    before parents), then to ``module`` itself: the wrapper API's
    ``auto_wrap_policy`` for the per-module API.

    Example::

        apply_policy(model, ModuleWrapPolicy({Block}), mp_policy=MixedPrecisionPolicy(torch.bfloat16))
        # same as: for b in model.blocks: fully_shard(b, mp_policy=...); fully_shard(model, mp_policy=...)

    Args:
        module: the root module.
        policy: a policy object or function from this module. A
            :class:`CustomPolicy` may return a dict of ``fully_shard`` arguments
            to override for one module.
        **fully_shard_kwargs: arguments for every ``fully_shard`` call (``mesh``,
            ``reshard_after_forward``, ``mp_policy``, ...).

    Returns:
        ``module``, now an ``FSDPModule``.
    """
    if not isinstance(module, nn.Module):
        raise ConfigTypeError(f"apply_policy expects an nn.Module, got {type(module).__name__}.")
    check_policy(policy, "apply_policy's policy")
    unknown = set(fully_shard_kwargs) - _FULLY_SHARD_ARGS
    if unknown:
        raise ConfigTypeError(
            f"apply_policy got unknown fully_shard argument(s) {sorted(unknown)}; it accepts "
            f"{sorted(_FULLY_SHARD_ARGS)}."
        )
    check_not_sharded(module, "apply_policy")
    ignored = fully_shard_kwargs.get("ignored_params")
    plan = plan_wrapping(module, policy, root_kwargs=fully_shard_kwargs, ignored_params=set(ignored or ()))
    for _, _, m in post_order(module):
        kwargs = plan.get(m)
        if kwargs is None:
            continue
        bad = set(kwargs) - _FULLY_SHARD_ARGS
        if bad:
            raise ConfigTypeError(
                f"the policy gave {type(m).__name__} unknown fully_shard argument(s) {sorted(bad)}; "
                f"use only {sorted(_FULLY_SHARD_ARGS)}."
            )
        fully_shard(m, **kwargs)
    return fully_shard(module, **fully_shard_kwargs)  # type: ignore[no-any-return]
