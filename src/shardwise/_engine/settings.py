"""What a front end may set on a group: the one place both APIs write.

``fully_shard``'s ``FSDPModule`` setters and the wrapper's constructor
options, ``no_sync`` and communication hooks all translate into these fields;
the engine only reads them. Nothing here is recomputed per step (that is the
group's plan) or changes during a step (its runtime state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import AllGather, DefaultAllGather, DefaultReduceScatter, ReduceScatter, WorkHandle
from shardwise.policies import MixedPrecisionPolicy


@dataclass
class GroupSettings:
    """Per-group options (defaults: PyTorch's ``fully_shard``)."""

    mp: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    # Reduce gradients in backward (off: accumulate unsharded, no communication).
    requires_grad_sync: bool = True
    # HSDP: all-reduce across replicas after the reduce-scatter.
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    # Whether backward needs this group's parameters at all.
    unshard_in_backward: bool = True
    # PyTorch's private _set_unshard_async_op: on CUDA its pre-forward and
    # pre-backward all-gathers then allocate on the default stream. shardwise
    # issues every gather as async work on one stream already: recorded only.
    unshard_async_op: bool = False
    # FSDP1's parameters: outside the group's own forward and backward the
    # modules show the sharded parameters, even while the gathered ones are
    # kept for backward (the root, SHARD_GRAD_OP), so model.parameters() is
    # always the same objects. fully_shard, like PyTorch's, leaves them registered.
    register_sharded_when_idle: bool = False
    # Divide reduced gradients by this instead of the data-parallel size.
    gradient_divide_factor: float | None = None
    # Split the division around the sum as FSDP1 does, in every dtype (see
    # GroupPlan.divide_factors); off: fully_shard's split.
    fsdp1_divide: bool = False
    # Called on the reduced gradient buffer before gradients are installed.
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    # Replaces the replicate all-reduce (HSDP / NO_SHARD), e.g. a comm hook;
    # returns a work handle, or None once the reduction is done.
    replicate_all_reduce: Callable[[torch.Tensor, dist.ProcessGroup], WorkHandle | None] | None = None
    # The ParamGroups to prefetch ([Note: prefetch order]): None is the
    # implicit order, [] none. (Typed Any: the group type imports this module.)
    forward_prefetch: list[Any] | None = None
    backward_prefetch: list[Any] | None = None
    # Issue the backward prefetch in post-backward (after this group's gradient
    # computation and reshard, before its reduce-scatter: FSDP1's BACKWARD_POST)
    # instead of in pre-backward (BACKWARD_PRE): less memory, later overlap.
    prefetch_in_post_backward: bool = False
    # Small groups' implicit prefetches go in runs ([Note: prefetch runs]);
    # off: one group ahead (the wrapper: FSDP1's limit_all_gathers).
    prefetch_runs: bool = True
    # Install reduced gradients in param_dtype (FSDP1's keep_low_precision_grads).
    keep_low_precision_grads: bool = False
    # With sync off and a reduce dtype other than the gradients', accumulate
    # them in the reduce dtype (fully_shard's); off: as autograd made them, in
    # the compute dtype, cast when reduced (FSDP1's flat gradient).
    accumulate_in_reduce_dtype: bool = True
    # A gradient that itself requires grad (backward(create_graph=True)) is a
    # RuntimeError, as in FSDP1; off: it is reduced detached (fully_shard's).
    refuse_grad_of_grad: bool = False
    # FSDP1's optimizer in backward: optimizers torch.distributed.optim's
    # _apply_optimizer_in_backward attached to a parameter step once its
    # sharded gradient is installed (fully_shard, like PyTorch's, leaves them).
    step_in_backward_optimizers: bool = False
    # Reduce zeros for trainable parameters without a gradient this backward.
    reduce_scatter_unused_params: bool = False
    # Groups of several dtypes: one all-gather per dtype instead of one packed
    # byte buffer (an engine knob for benchmarks; packing measured faster).
    all_gather_per_dtype: bool = False
    all_gather_comm: AllGather = field(default_factory=DefaultAllGather)
    reduce_scatter_comm: ReduceScatter = field(default_factory=DefaultReduceScatter)


__all__ = ["GroupSettings"]
