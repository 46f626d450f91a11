"""``FullyShardedDataParallel.summon_full_params``: the wrappers' full
parameters (and gradients) exposed outside forward and backward, with
FSDP1's refusals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise._engine.module_state import state_of, states_under
from shardwise._engine.param_group import ParamGroup, TrainingState
from shardwise._engine.sharded_param import set_param
from shardwise.errors import SummonError, UnsupportedError
from shardwise.fully_shard import summon_full_params as engine_summon

from .managed import is_wrapper
from .state_dict import chunk_of_whole, root_wrappers, warn_cpu_copies_on_every_rank, whole, wrappers_under
from .config import ShardingStrategy

__all__ = ["summon", "check_idle"]

_SUMMONING: set[int] = set()  # ids of the groups inside a summon_full_params now


@contextlib.contextmanager
def summon(
    module: nn.Module, recurse: bool, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Iterator[None]:
    """The body of ``FullyShardedDataParallel.summon_full_params`` (its
    arguments checked for type already)."""
    if rank0_only and writeback:
        raise UnsupportedError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: the other ranks "
            "hold only shards, so writing back would make ranks disagree. Pass writeback=False."
        )
    if offload_to_cpu and not rank0_only:
        # FSDP1 checks each wrapper's arguments twice (summon, then unshard), warning each time.
        if recurse:
            units = len(wrappers_under(module))
        else:
            units = 1 if is_wrapper(module) else 0
        for _ in range(2 * units):
            warn_cpu_copies_on_every_rank()
    checked: list[Any] = list(wrappers_under(module)) if recurse else [module] if is_wrapper(module) else []
    for unit in checked:  # FSDP1's refusals, each unit's
        if with_grads and (offload_to_cpu or not unit._use_orig_params):
            raise UnsupportedError(
                f"with_grads={with_grads}, use_orig_params={unit._use_orig_params}, "
                f"offload_to_cpu={offload_to_cpu} is not supported yet (as in PyTorch's FSDP: with_grads "
                "needs use_orig_params=True and offload_to_cpu=False)"
            )
        own = state_of(unit._fsdp_unit)
        if offload_to_cpu and unit._plan.strategy == ShardingStrategy.NO_SHARD and own is not None and own.group is not None:
            raise UnsupportedError(
                "offload_to_cpu=True and NO_SHARD is not supported yet (as in PyTorch's FSDP: a NO_SHARD "
                "unit's parameters are whole already; summon without offload_to_cpu)"
            )
    roots = cast(list[Any], root_wrappers(module))
    for root in roots:  # FSDP1's lazy init: a summon before any forward decides the root
        root._lazy_init()
    targets: list[nn.Module] = list(roots) if recurse else [r._fsdp_unit for r in roots]
    groups = [
        s.group
        for t in targets
        for s in (states_under(t) if recurse else [state_of(t)])
        if s is not None and s.group is not None
    ]
    check_idle(groups)
    if any(id(g) in _SUMMONING for g in groups):
        raise SummonError(
            "Cannot manually unshard parameters when already unsharding parameters: "
            "summon_full_params (or FSDP.apply) inside another over the same wrapper; "
            "use the outer context's full parameters."
        )
    with contextlib.ExitStack() as stack:
        _SUMMONING.update(id(g) for g in groups)
        stack.callback(_SUMMONING.difference_update, [id(g) for g in groups])
        for t in targets:
            if any(s.group is not None for s in (states_under(t) if recurse else [state_of(t)]) if s is not None):
                stack.enter_context(engine_summon(t, recurse=recurse, writeback=writeback))
        if rank0_only and dist.get_rank() != 0:
            for g in groups:
                g.reshard()
        elif with_grads or (offload_to_cpu and any(g.device.type != "cpu" for g in groups)):
            stack.enter_context(_expose(groups, with_grads, offload_to_cpu, writeback))
        yield


def check_idle(groups: list[ParamGroup]) -> None:
    """summon_full_params only outside forward and backward."""
    for g in groups:
        root = g.ctx.root
        busy = [x for x in (g, root.group if root is not None else None) if x is not None and x.training_state != TrainingState.IDLE]
        if busy:
            raise SummonError(
                "Cannot manually unshard parameters during forward/backward: "
                f"summon_full_params cannot run inside forward or backward ({busy[0].name} is in "
                f"{busy[0].training_state.name}); call it before the forward or after the backward."
            )


@contextlib.contextmanager
def _expose(groups: list[ParamGroup], with_grads: bool, offload_to_cpu: bool, writeback: bool) -> Iterator[None]:
    """Inside an engine summon: register CPU copies of the full parameters
    (``offload_to_cpu``) and/or gather gradients onto them (``with_grads``)."""
    swapped: list[tuple[Any, nn.Parameter]] = []
    graded: list[tuple[Any, nn.Parameter, torch.Tensor]] = []
    try:
        for g in groups:
            for sp in g.params:
                full = sp.unsharded_param
                if full is None:
                    continue
                exposed = full
                if offload_to_cpu and full.device.type != "cpu":
                    exposed = nn.Parameter(full.detach().cpu(), requires_grad=full.requires_grad)
                    for owner, attr in sp.owners:
                        set_param(owner, attr, exposed)
                    swapped.append((sp, exposed))
                grad = sp.sharded_param.grad
                if with_grads and grad is not None:
                    full_grad = whole(grad, sp) if isinstance(grad, DTensor) else grad
                    exposed.grad = full_grad.to(exposed.device, exposed.dtype)
                    graded.append((sp, exposed, exposed.grad))
        yield
    finally:
        for sp, p, given in graded:
            # Changed in place: this rank's part goes back, as FSDP1's views of
            # its flat gradient do (a gradient assigned anew is dropped there too).
            if writeback and p.grad is given and sp.sharded_param.grad is not None:
                grad = sp.sharded_param.grad
                with torch.no_grad():
                    if isinstance(grad, DTensor):
                        changed = p.grad.to(grad.device, grad.dtype)
                        grad._local_tensor.copy_(chunk_of_whole(changed, grad, sp))
                    else:
                        grad.copy_(p.grad)
            p.grad = None
        for sp, exposed in swapped:
            if writeback:
                with torch.no_grad():
                    sp.unsharded_param.copy_(exposed)
            sp.register_unsharded()
