"""PyTorch FSDP communication hooks on the engine's ``ReduceScatter`` interface.

A sharded-strategy hook has the signature ``hook(state, grad, output)``:
``grad`` is the flat, unsharded gradient laid out rank-major (exactly the
engine's reduce-scatter input) and ``output`` receives this rank's reduced
shard, averaged by the hook itself (so the engine's own division is turned
off, ``gradient_divide_factor = 1``). The hooks of
``torch.distributed.algorithms._comm_hooks.default_hooks`` all work;
``fp16_compress_hook`` / ``bf16_compress_hook`` are run by an equivalent that
skips their CUDA-only ``record_stream`` call on other devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks

from shardwise._engine.collectives import RAISE_AS_IS
from shardwise.comm import FreshBuffers, ReduceScatter

__all__ = ["CommHookReduceScatter", "CommHookAllReduce"]

_LOW_PRECISION = {
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


def _call(hook: Callable[..., Any], *args: Any) -> Any:
    """Run a user's hook; its own error reaches the caller as it is, as with FSDP1
    (not as the engine's CollectiveError for custom collectives)."""
    try:
        return hook(*args)
    except Exception as exc:
        setattr(exc, RAISE_AS_IS, True)
        raise


def _low_precision_reduce_scatter(prec: torch.dtype, state: Any, grad: torch.Tensor, output: torch.Tensor) -> None:
    """``default_hooks._low_precision_hook`` for the sharded case, without
    ``record_stream`` (CUDA only): cast, pre-divide, reduce-scatter,
    post-divide, cast back to ``state.parameter_type``."""
    low = grad.to(prec)
    out = torch.empty(output.shape, dtype=prec, device=output.device)
    default_hooks.reduce_scatter_hook(state, low, out)
    output.copy_(out.to(state.parameter_type))


class CommHookAllReduce:
    """Run a PyTorch FSDP ``NO_SHARD`` communication hook, ``hook(state, grad)``
    (an in-place all-reduce of the flat gradient), as the engine's replicate
    all-reduce (synchronously: the hook issues its own collectives)."""

    def __init__(self, hook: Callable[..., Any], state: object) -> None:
        self.hook = hook
        self.state = state

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        prec = _LOW_PRECISION.get(self.hook)
        if prec is not None and tensor.device.type != "cuda":
            # default_hooks._low_precision_hook without its CUDA-only record_stream
            low = tensor.to(prec)
            default_hooks.allreduce_hook(self.state, low)  # type: ignore[arg-type]
            tensor.copy_(low)
            return None
        # The hook may swap .data for another dtype: hand it a copy, copy back.
        work = tensor.clone()
        _call(self.hook, self.state, work)
        tensor.copy_(work)
        return None


class CommHookReduceScatter(FreshBuffers, ReduceScatter):
    """Run a PyTorch FSDP sharded-strategy communication hook as the engine's
    reduce-scatter (synchronously: the hook issues its own collectives)."""

    def __init__(self, hook: Callable[..., Any], state: object) -> None:
        self.hook = hook
        self.state = state

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        prec = _LOW_PRECISION.get(self.hook)
        if prec is not None and input_tensor.device.type != "cuda":
            _low_precision_reduce_scatter(prec, self.state, input_tensor, output_tensor)
            return None
        # The hook may swap .data of its arguments for another dtype (compression
        # hooks do): hand it a fresh output and copy the result, cast, into ours.
        out = torch.empty_like(output_tensor)
        _call(self.hook, self.state, input_tensor, out)
        output_tensor.copy_(out)
        return None
