"""Per-``fully_shard``-call state: the forward/backward hooks that drive a
``ParamGroup``, lazy root initialisation at the first forward, and the root's
end-of-backward callback.

[Note: post-backward trigger]
A group's post-backward (reduce-scatter, reshard) runs when the gradient with
respect to its module's *inputs* is computed (an identity autograd function
wraps the inputs in pre-forward): by then every node that uses the module's
unsharded parameters has run. Modules whose inputs need no gradient (an
embedding over token ids) and anything the hooks missed are handled by the
root's final callback, queued at the first pre-backward of each backward.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.autograd.graph import register_multi_grad_hook

from shardwise.errors import ConfigTypeError, UnsupportedError
from shardwise.policies import MixedPrecisionPolicy

from .param_group import IterationContext, ParamGroup, TrainingState
from .trace import log_hook, trace
from .trees import cast_floats, grad_tensors, map_tensors, replace_grad_tensors


# module -> its state. Weak both ways, so that dropping a model frees it, its
# state, groups and process groups: a state holds its modules, so a strong
# value would keep its own weak key alive forever. The module keeps its state
# alive through the hooks the state registered on it.
_STATES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ModuleState]] = weakref.WeakKeyDictionary()


class dynamo_disable:  # noqa: N801 - used as a decorator
    """Run a method eagerly, outside any graph ``torch.compile`` traces (as
    PyTorch's FSDP does with its hooks): collectives, storage resizing and
    Python bookkeeping stay out of the compiled region; the block's compute is
    one graph. See docs/decisions.md ("torch.compile").

    [Note: hooks outside the traced region]
    At the first attribute access (``fully_shard`` time: importing
    ``torch._dynamo`` at ``import shardwise`` would cost about a second) the
    method is wrapped by ``torch._dynamo.disable`` and the wrapped function
    replaces this descriptor on its class. So dynamo never meets a Python
    frame of ours, not even this ``__get__``: a plain wrapper function would
    itself be a frame dynamo tries to compile when a compiled module's
    ``_call_impl`` runs the hook, and each such attempt is a graph break
    (PyTorch's wrapper escapes this only because its file is on dynamo's
    skip list). The same goes for the methods user code may call inside a
    compiled function (``unshard``, ``reshard``, a handle's ``wait``) and an
    autograd Function's ``backward`` (``static=True``; the autograd engine
    looks it up on the class), which a ``loss.backward()`` in a compiled
    function would otherwise have dynamo trace, reduce-scatters and all.
    """

    def __init__(self, fn: Callable[..., Any], *, static: bool = False) -> None:
        self.fn = fn
        self.static = static
        self.owner: type | None = None
        self.name = fn.__name__
        self.disabled: Callable[..., Any] | None = None
        functools.update_wrapper(cast(Any, self), fn)

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name
        _UNRESOLVED.append(self)

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None and not self.static:
            return self  # introspection of the class (docs, signatures)
        disabled = self.resolve()
        return disabled if self.static else types.MethodType(disabled, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)  # called on the class: FSDPModule.unshard(m)

    def resolve(self) -> Callable[..., Any]:
        """The disabled function, made once; it replaces this descriptor on its class."""
        if self.disabled is None:
            import torch._dynamo

            self.disabled = torch._dynamo.disable(  # type: ignore[no-untyped-call]
                self.fn, recursive=True, reason="shardwise hooks"
            )
            if self.owner is not None:
                setattr(self.owner, self.name, staticmethod(self.disabled) if self.static else self.disabled)
        return self.disabled


# Descriptors still on their classes: all replaced when the first module state
# is made, so that not even a descriptor's __get__ is met inside a compiled
# function (a first unshard() there would break its graph twice).
_UNRESOLVED: list[dynamo_disable] = []


def _resolve_all() -> None:
    while _UNRESOLVED:
        _UNRESOLVED.pop().resolve()


def dynamo_disable_static(fn: Callable[..., Any]) -> Any:
    """:class:`dynamo_disable` for a static method (an autograd Function's ``backward``)."""
    return dynamo_disable(fn, static=True)


def refuse_compiled_autograd() -> None:
    """Compiled autograd (``torch._dynamo.config.compiled_autograd``, or its
    ``_enable`` context) runs a backward's hooks in its own order, and the
    reduce-scatters then take gradients not yet complete: wrong gradients,
    under PyTorch's ``fully_shard`` too (torch 2.13). Refused at the first hook
    of such a backward, on every rank alike, before any collective."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region:
        raise UnsupportedError(
            "compiled autograd is not supported with sharded modules: the backward of a fully_shard "
            "module ran under torch._dynamo.config.compiled_autograd (or compiled_autograd._enable), "
            "which reorders FSDP's reduce-scatters and gives wrong gradients; turn compiled autograd "
            "off for this backward (torch.compile of the forward, and of each block, is supported)"
        )


def state_of(module: nn.Module) -> ModuleState | None:
    ref = _STATES.get(module)
    return ref() if ref is not None else None


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward triggers post-backward.

    ``forward`` takes ``ctx`` (as PyTorch's FSDP does): with a separate
    ``setup_context``, every ``apply`` binds its arguments to ``forward``'s
    signature through ``inspect`` (0.1 ms of a 0.24 ms call under cProfile,
    once per group per forward). functorch transforms accept only that
    form, so while one is active :class:`_PostBackwardTransformable` is
    applied instead."""

    @staticmethod
    def forward(ctx: Any, state: ModuleState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @dynamo_disable_static
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, _state_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forward-mode AD (dual tensors): the identity (views, since forward
        returns its inputs as they are)."""
        return tuple(t.view_as(t) for t in tangents)


class _PostBackwardTransformable(torch.autograd.Function):
    """:class:`_PostBackward` in the form functorch transforms
    (``torch.func.jvp``, ``vmap``) accept: forward and ``setup_context`` apart."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: ModuleState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    backward = dynamo_disable_static(_PostBackward.__dict__["backward"].fn)
    jvp = staticmethod(_PostBackward.jvp)


class _PreBackwardTransformable(torch.autograd.Function):
    """Identity on one floating output of a group's forward run under a
    functorch transform (``torch.func.jvp``, ``vmap``), whose backward runs the
    group's pre-backward. Inside a transform an output that outer autograd
    tracks can report ``requires_grad=False``, so no tensor hook would be
    registered on it and the outer backward would find the parameters
    resharded (PyTorch's FSDP applies the same identity there)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: ModuleState, output: torch.Tensor) -> torch.Tensor:
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.state._pre_backward_hook(grad)
        return None, grad

    @staticmethod
    def jvp(ctx: Any, _state_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        # the tangent keeps the pre-backward on its own backward path
        return None if tangent is None else _PreBackwardTransformable.apply(ctx.state, tangent)  # type: ignore[no-untyped-call]


class ModuleState:
    """Hooks and lifecycle for the module(s) of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[ParamGroup],
        mp: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
        device: torch.device,
    ) -> None:
        _resolve_all()
        self.modules = modules
        # One group per mesh its parameters use (several only with per-parameter
        # meshes from shard_placement_fn); ``group`` is the first, or None.
        self.groups = groups
        self.group = groups[0] if groups else None
        self.mp = mp
        self.device = device
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None  # decided at the first forward
        # Set by fully_shard: PyTorch's fully_shard warns when an output needing
        # gradients is a view (an in-place op on it would drop the pre-backward
        # hook), and finds outputs' tensors without opening sets; FSDP1 (the
        # wrapper) does not warn and opens sets.
        self.fully_shard_rules = False
        # A parameter another fully_shard already manages (found by fully_shard,
        # reported at the first forward, as PyTorch does), and what names it.
        self.conflict: str | None = None
        self.shared_claims: list[tuple[object, nn.Module, str]] = []
        self.ctx: IterationContext[ModuleState] = groups[0].ctx if groups else IterationContext()
        for group in groups[1:]:
            group.ctx = self.ctx
        self.name = type(modules[0]).__name__
        # For a list of modules: those whose forward has not finished yet.
        self._modules_to_run: set[int] = set()
        self._hook_handles = []
        for module in modules:
            _STATES[module] = weakref.ref(self)
            self._hook_handles.append(
                module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            )
            self._hook_handles.append(module.register_forward_hook(self._post_forward_hook, prepend=False))
        # Saving or loading a state dict always sees the sharded parameters,
        # even right after a forward that kept them unsharded (e.g. the root).
        owners = {id(m): m for group in groups for p in group.params for m, _ in p.owners}
        for owner in owners.values():
            owner.register_state_dict_pre_hook(lambda *_a, **_k: self._reshard_for_state_dict())  # type: ignore[no-untyped-call]
            owner.register_load_state_dict_pre_hook(lambda *_a, **_k: self._reshard_for_state_dict())  # type: ignore[no-untyped-call]
            # a function, not a bound method: copy.deepcopy of a plain submodule
            # copies a bound method's instance (this state), not a function
            owner.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
                lambda module, incompatible: self._check_loaded_params(module, incompatible)
            )

    def _reshard_for_state_dict(self) -> None:
        for group in self.groups:
            group.reshard_for_state_dict()

    def _check_loaded_params(self, module: nn.Module, _incompatible: Any) -> None:
        """After ``module`` loaded a state dict: ``assign=True`` may have put a
        plain tensor where a sharded parameter belongs, which would leave the
        model silently unsharded. Put the shards back and say so. Sharded
        parameters it assigned are adopted at the group's next unshard (as
        PyTorch resets its sharded parameters after such a load)."""
        for group in self.groups:
            for p in group.params:
                for owner, name in p.owners:
                    current = owner._parameters.get(name)
                    if owner is not module or current is None:
                        continue
                    if isinstance(current, DTensor):
                        if current is not p.sharded_param:
                            group.needs_readopt = True
                        continue
                    for q in group.params:
                        q.register_sharded()
                    raise ConfigTypeError(
                        f"load_state_dict(assign=True) gave {p.fqn} (in {self.name}) a whole "
                        f"{type(current).__name__} of shape "
                        f"{tuple(current.shape)} where fully_shard keeps a sharded DTensor parameter; the "
                        "module keeps its sharded parameters. Load a sharded state dict (DTensors, as "
                        "model.state_dict() gives), or a full one with torch.distributed.checkpoint.state_dict."
                        "set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))."
                    )

    # ---- lazy init ------------------------------------------------------------
    def lazy_init(self) -> None:
        """Make this state the root of every state in its modules' subtrees."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {len(self.modules)} modules (sharded "
                "together in one fully_shard call), and the first forward ran through one of them. "
                "Apply fully_shard to their common parent and run forward through it."
            )
        self.is_root = True
        # Keep the root's own context: settings made before the first forward
        # (set_post_optim_event, set_reduce_scatter_max_input_buffers) must survive.
        ctx = self.ctx
        ctx.root = self
        states: list[ModuleState] = []
        seen: set[int] = set()
        for module in self.modules:
            for name, sub in module.named_modules():
                state = state_of(sub)
                if state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                states.append(state)
                if state is not self:
                    if state.is_root:
                        self.is_root = None
                        raise RuntimeError(
                            f"FSDP state has already been lazily initialized for {name}\n"
                            "FSDP requires running forward through the root module first: "
                            f"{name} ({state.name}) ran forward on its own before its parent "
                            f"{self.name}. Run the whole model's forward first."
                        )
                    state.is_root = False
                    state.name = name or state.name
        if any(state.conflict is not None for state in states):
            self.is_root = None
            raise ValueError(_shared_parameter_message(self.modules[0], states))
        ctx.states = states
        for state in states:
            state.ctx = ctx
            for i, group in enumerate(state.groups):
                group.ctx = ctx
                group.name = state.name if state is not self else f"{state.name} (root)"
                group.module_fqn = state.name if state is not self else ""
                if i:
                    group.name += f" [mesh {i}]"
                group.reset_sharded_params()
        # as PyTorch's: the first group (the root's first) with any, named from the root
        names = {id(param): name for name, param in self.modules[0].named_parameters()}
        on_meta: list[str] = []
        for group in (group for state in states for group in state.groups):
            on_meta = [names.get(id(p.sharded_param), p.fqn) for p in group.params if p.sharded_param.device.type == "meta"]
            if on_meta:
                break
        if on_meta:
            self.is_root = None
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the "
                f"following were still on meta device: {on_meta}\nFor example, call "
                "module.to_empty(device=...) to materialize them and reset_parameters() on each "
                "module (or your init function) to initialize values."
            )
        if self.auto_reshard_after_forward:
            # The root's backward starts right after its forward: keep its params.
            for group in self.groups:
                group.set_reshard_after_forward(False)

    # ---- forward --------------------------------------------------------------
    # [Note: modules sharded together]
    # fully_shard([a, b, ...]) makes one group of several modules. Its forward
    # starts with the first of them to run (gather, prefetch, post-backward
    # on its inputs) and ends with the last (reshard, pre-backward hook), as
    # PyTorch's grouped hooks do; every member in between gets its inputs
    # cast, the group gathered again if a backward in between resharded it (a
    # member called on its own per chunk of a loss), and the group's
    # pre-backward hook on its outputs, so that whatever runs of the group
    # finds it gathered in backward. A member that never runs leaves the
    # group to the root's post-forward, which completes it (its pre-backward
    # hook also on the root's outputs); the end of backward forgets what was
    # left. A member recomputed in backward (activation checkpointing) only
    # finds the group gathered: the post-backward reshards it.
    @dynamo_disable
    def _pre_forward_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if len(self.modules) > 1:
            if torch._C._current_graph_task_id() != -1:  # recomputed in backward
                return self._member_pre_forward(args, kwargs)
            if self._modules_to_run and all(g.training_state == TrainingState.FORWARD for g in self.groups):
                return self._member_pre_forward(args, kwargs)
            if not self._modules_to_run:
                self._modules_to_run = {id(m) for m in self.modules}
        return self.pre_forward(args, kwargs)

    @dynamo_disable
    def _post_forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if len(self.modules) > 1:
            recompute = torch._C._current_graph_task_id() != -1
            if not recompute and id(module) in self._modules_to_run:
                self._modules_to_run.discard(id(module))
                if not self._modules_to_run:
                    return self.post_forward(output)
            if self.mp.output_dtype is not None:
                output = cast_floats(output, self.mp.output_dtype)
            if not recompute and torch.is_grad_enabled():
                output = self._register_pre_backward(output)
            return output
        return self.post_forward(output)

    def _member_pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """A later member of a group of modules, or one recomputed in backward:
        see [Note: modules sharded together]."""
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
        for group in self.groups:
            group.ensure_unsharded()
        return args, kwargs

    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self.lazy_init()
        if self.is_root and self.ctx.final_callback_queued and torch._C._current_graph_task_id() == -1:
            self._recover_from_aborted_backward()
        if self.is_root:
            log_hook("FSDP::root_pre_forward")
        with trace(f"shardwise::pre_forward ({self.name})"):
            if self.is_root and self.device.type != "cpu":
                args, kwargs = map_tensors(self._to_device, (args, kwargs))
            if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
                args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
            for group in self.groups:
                group.pre_forward()
            if self.groups and torch.is_grad_enabled():
                args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self, output: Any) -> Any:
        with trace(f"shardwise::post_forward ({self.name})"):
            for group in self.groups:
                group.post_forward()
            if self.mp.output_dtype is not None:
                output = cast_floats(output, self.mp.output_dtype)
            if torch.is_grad_enabled():
                output = self._register_pre_backward(output)
            if self.is_root:
                output = self._root_post_forward(output)
        return output

    # register_fsdp_forward_method's hooks around another method (generate):
    # outside any graph torch.compile traces, as the module hooks ([Note: hooks
    # outside the traced region]); the method's own body is traced.
    @dynamo_disable
    def method_pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return self.pre_forward(args, kwargs)

    @dynamo_disable
    def method_post_forward(self, output: Any) -> Any:
        # A method that runs the module's own forward inside (generate) has
        # ended that forward already: as under PyTorch, this second
        # post-forward then reshards fully, the root's groups included.
        ended = [g for g in self.groups if g.training_state == TrainingState.IDLE]
        output = self.post_forward(output)
        for group in ended:
            group.reshard()
        return output

    def _register_pre_backward(self, output: Any) -> Any:
        tensors = grad_tensors(output, in_sets=not self.fully_shard_rules)
        if self.fully_shard_rules:
            for t in tensors:  # once per view, as PyTorch warns
                if t._base is not None:
                    self._warn_view_output()
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        if torch._C._are_functorch_transforms_active():
            return map_tensors(self._through_pre_backward, output)
        return output

    def _through_pre_backward(self, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad or not (t.is_floating_point() or t.is_complex()):
            return t
        return _PreBackwardTransformable.apply(self, t)  # type: ignore[no-any-return, no-untyped-call]

    def _warn_view_output(self) -> None:
        names = ", ".join(type(m).__name__ for m in self.modules) or "?"
        warnings.warn(
            f"FSDP2-wrapped module ({names}) returned a view tensor. An in-place op on this view "
            "(e.g., `x += y`) will silently drop the pre-backward hook and skip the all-gather, which "
            "can cause backward to fail or produce wrong gradients. Use out-of-place ops "
            "(`out = out + y`, not `out += y`) or `.clone()` the output before any in-place op.",
            UserWarning,
            stacklevel=3,
        )

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device:
            return x.to(self.device, non_blocking=True)
        return x

    def _root_post_forward(self, output: Any) -> Any:
        ctx = self.ctx
        ctx.freeze_forward_order()
        for state in ctx.states:
            if state is self:
                continue
            if state._modules_to_run:  # a group of modules some of which never ran
                state._modules_to_run.clear()
                for group in state.groups:
                    group.post_forward()
                if torch.is_grad_enabled():
                    output = state._register_pre_backward(output)
            for group in state.groups:
                group.drop_unused_prefetch()
        return output

    def _register_post_backward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        inputs = grad_tensors((args, kwargs))
        if not inputs:
            return args, kwargs
        fn = _PostBackwardTransformable if torch._C._are_functorch_transforms_active() else _PostBackward
        outs = iter(fn.apply(self, *inputs))  # type: ignore[no-untyped-call]
        new_args, new_kwargs = replace_grad_tensors((args, kwargs), outs)
        return new_args, new_kwargs

    # ---- backward -------------------------------------------------------------
    @dynamo_disable
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        refuse_compiled_autograd()
        ctx = self.ctx
        if not ctx.final_callback_queued and ctx.root is not None:
            ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(ctx.root.finalize_backward)
        if self.groups:
            with trace(f"shardwise::pre_backward ({self.name})"):
                for group in self.groups:
                    group.pre_backward()

    def post_backward(self) -> None:
        refuse_compiled_autograd()
        for group in self.groups:
            group.post_backward()

    @dynamo_disable
    def finalize_backward(self) -> None:
        """The root's end-of-backward callback: every group under the root."""
        ctx = self.ctx
        log_hook("FSDP::root_post_backward")
        with trace("shardwise::finalize_backward"):
            try:
                for state in ctx.states:
                    state._modules_to_run.clear()  # members called on their own (chunks of a loss)
                    for group in state.groups:
                        group.finalize_backward()
                # Gradients are installed at the end of every backward; the last
                # one (set_is_last_backward) is where PyTorch waits on streams,
                # which shardwise's async work handles make unnecessary.
                ctx.drain(keep=0)
                for state in ctx.states:
                    for group in state.groups:
                        group.wait_for_offloaded_grads()  # before the optimizer reads them
                ctx.pool.clear()  # [Note: reused buffers]: nothing pooled outlives the backward
            finally:
                ctx.post_forward_order.clear()
                ctx.run_pending = 0
                ctx.final_callback_queued = False

    def _recover_from_aborted_backward(self) -> None:
        """A new iteration while the last backward never reached its end
        (it raised): do what ``reset_iter_state()`` does, rather than let
        that step's unreduced gradients leak into this one or leave this
        backward without its end-of-backward callback."""
        warnings.warn(
            f"{self.name}: the previous backward did not finish (an exception inside it?); "
            "shardwise reset the iteration state as reset_iter_state() does, dropping that "
            "step's unreduced gradients. Call reset_iter_state() on the root after catching "
            "such an exception to make this explicit.",
            stacklevel=4,
        )
        self.reset_iter_state()

    def reset_lazy_init(self) -> None:
        """Undo :meth:`lazy_init` of this root: the next forward decides the
        root again (FSDP1's ``apply()`` on a wrapper not yet initialised
        initialises it to gather, then resets it: it may be a child whose
        parent is wrapped later)."""
        if self.is_root is not True:
            return
        for state in self.ctx.states or [self]:
            state.is_root = None
        self.ctx.root = None
        self.ctx.states = []

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward/backward: finish collectives,
        reshard, drop this iteration's trackers and pending gradients."""
        if self.is_root is False:
            raise RuntimeError(
                f"reset_iter_state() must be called on the root FSDP module (the one the model's "
                f"forward runs through), not on {self.name}."
            )
        ctx = self.ctx
        for state in ctx.states or [self]:
            state._modules_to_run.clear()
            for group in state.groups:
                group.abort_step()
        ctx.abandon_pending()
        ctx.post_forward_order.clear()
        ctx.run_pending = 0
        ctx.recording = []
        ctx.final_callback_queued = False


def states_under(module: nn.Module) -> list[ModuleState]:
    """Every distinct state in ``module``'s subtree, in module order."""
    out: list[ModuleState] = []
    seen: set[int] = set()
    for sub in module.modules():
        state = state_of(sub)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            out.append(state)
    return out


def _shared_parameter_message(root: nn.Module, states: list[ModuleState]) -> str:
    """PyTorch's error for a parameter in two groups, naming the one PyTorch
    names: walking the states in the root's module order, each group's
    parameters in order, the first met twice, by its first place under the
    root among that group's modules (PyTorch registers a new parameter there)."""
    paths = {id(m): f"{path}." if path else "" for path, m in root.named_modules()}
    seen: dict[int, str] = {}
    for state in states:
        for managed_by, mod, attr in state.shared_claims:
            fqn = paths.get(id(mod), "") + attr
            if id(managed_by) in seen:
                return (
                    f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP group. "
                    "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the "
                    f"same FSDP group. (Its other place: '{seen[id(managed_by)]}'; sharding only their common "
                    "parent works too.)"
                )
            seen[id(managed_by)] = fqn
    # The other group is not under this root (PyTorch would not notice): name it.
    conflict = next(state.conflict for state in states if state.conflict is not None)
    return (
        f"Parameter {conflict}, outside this root. For shared/tied parameters, use "
        "fully_shard([module_a, module_b]) to place them in the same FSDP group, or shard only their common parent."
    )

