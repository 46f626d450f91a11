"""Communication interfaces: how buffers are allocated and how collectives are
issued. The engine's defaults implement the same interfaces, so there is one
code path whether or not a user installs a custom collective."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

# torch >= 2.13 names them *_single (the *_tensor names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Comm", "AllGather", "ReduceScatter", "DefaultAllGather", "DefaultReduceScatter", "FreshBuffers", "WorkHandle"]


class WorkHandle(Protocol):
    """What an async collective returns: ``torch.distributed.Work`` or anything
    with a ``wait()`` that completes it."""

    def wait(self, *args: Any, **kwargs: Any) -> Any: ...


class Comm(ABC):
    """How a collective's memory is allocated (per call or a persistent buffer;
    from a special pool or the normal allocator)."""

    @abstractmethod
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return a buffer of ``size``, ``dtype`` on ``device`` to communicate in.

        Args:
            size: the buffer's shape.
            dtype: its dtype.
            device: its device.
        """


class AllGather(Comm):
    """An all-gather: ``output_tensor`` receives every rank's ``input_tensor``
    concatenated in rank order along dim 0."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> WorkHandle | None:
        """Issue the all-gather; return a work handle when ``async_op``."""


class ReduceScatter(Comm):
    """A reduce-scatter: ``output_tensor`` receives this rank's slice of the
    reduction (``op``) of every rank's ``input_tensor``."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> WorkHandle | None:
        """Issue the reduce-scatter; return a work handle when ``async_op``."""


def all_gather_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> WorkHandle | None:
    """``torch.distributed``'s all-gather into one tensor, under its current name.
    One-byte floats (float8, e.g. torchao's all-gathered weights) travel as
    bytes: gloo has no float8 type, and an all-gather moves bytes unchanged."""
    if input_tensor.dtype.is_floating_point and input_tensor.dtype.itemsize == 1:
        output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
    return cast("WorkHandle | None", _all_gather(output_tensor, input_tensor, group=group, async_op=async_op))


class FreshBuffers(Comm):
    """``allocate`` from the normal allocator, a fresh buffer per call (so
    results may alias it). A base for collectives that only change the call."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class DefaultAllGather(FreshBuffers, AllGather):
    """A fresh buffer per call; ``all_gather_into_tensor``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> WorkHandle | None:
        return all_gather_tensor(output_tensor, input_tensor, group, async_op)


class DefaultReduceScatter(FreshBuffers, ReduceScatter):
    """A fresh buffer per call; ``reduce_scatter_tensor``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> WorkHandle | None:
        work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        return cast("WorkHandle | None", work)
