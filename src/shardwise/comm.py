"""Communication interfaces: how buffers are allocated and how collectives are
issued. The engine's defaults implement the same interfaces, so there is one
code path whether or not a user installs a custom collective."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

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
    if _exchanges(group, output_tensor, input_tensor):
        return _finish(exchange_all_gather(output_tensor, input_tensor, group), async_op)
    return cast("WorkHandle | None", _all_gather(output_tensor, input_tensor, group=group, async_op=async_op))


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> WorkHandle | None:
    """``torch.distributed``'s reduce-scatter into one tensor, under its current name
    (on gloo a pairwise exchange, see [Note: pairwise exchange on gloo])."""
    if op == dist.ReduceOp.SUM and _exchanges(group, output_tensor, input_tensor) and group.size() == 2:
        return _finish(exchange_reduce_scatter(output_tensor, input_tensor, group), async_op)
    return cast("WorkHandle | None", _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op))


# [Note: pairwise exchange on gloo]
# gloo's all-gather gathers into a flat buffer of its own and copies that into
# the output; its reduce-scatter clones the input, all-reduces the clone and
# copies this rank's chunk out (twice the bytes of a reduce-scatter on the
# wire). On CPU those copies and bytes are CPU time taken from compute. Over a
# gloo group, shardwise's own collectives therefore exchange chunks pairwise
# with gloo's point-to-point send / recv, which read and write the tensors in
# place: the all-gather receives each rank's input straight into its row of
# the output (each rank sends its input to every other, (world - 1) times its
# size, as a ring does). The reduce-scatter over two ranks sends the other
# rank its row and adds the row it receives to its own: the same two numbers
# added as gloo adds them, so results are bit for bit gloo's. Over more ranks
# the order of a sum decides its last bits, and gloo's ring orders each
# element's sum by where it falls in the buffer; a sum in any other order
# would move results off gloo's (and off DDP's) by rounding, which AdamW
# magnifies on near-zero gradients, so there gloo's own reduce-scatter runs.
# Under a Python dispatch mode (``CommDebugMode``, shardwise's memory tracker,
# fake tensors) the collectives stay gloo's, so whoever counts them sees
# what PyTorch's FSDP issues, and a plan matches its measurement. Other
# backends are left as they are.

_TAG_BASE = 1 << 30  # well above the tags user code sends with
# Per process group (dropped with it): the next tag, and whether it is gloo.
_tags: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_backend_ok: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()


def _exchanges(group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether a collective of ours over ``group`` is done as a pairwise exchange."""
    if group is None:
        return False
    ok = _backend_ok.get(group)
    if ok is None:
        try:
            # "gloo", or gloo for CPU tensors in a group of several backends ("cpu:gloo,cuda:nccl")
            backends = str(dist.get_backend(group)).split(",")
            ok = any(b in ("gloo", "cpu:gloo") for b in backends) and group.size() > 1
        except (RuntimeError, ValueError, TypeError):
            ok = False
        _backend_ok[group] = ok
    if not ok or output.device.type != "cpu" or not (output.is_contiguous() and input.is_contiguous()):
        return False
    # Under a dispatch mode (CommDebugMode, a memory tracker, fake tensors)
    # whoever counts collectives sees the ones PyTorch's FSDP issues.
    return torch._C._len_torch_dispatch_stack() == 0 and not isinstance(output, FakeTensor)


def _next_tag(group: dist.ProcessGroup) -> int:
    """A tag every rank of ``group`` draws alike (they issue our collectives in one order)."""
    n = _tags.get(group, 0)
    _tags[group] = (n + 1) % _TAG_BASE
    return _TAG_BASE + n


class _Exchange:
    """The sends and receives of one exchange; ``wait`` completes them, then
    runs ``then`` (the reduce-scatter's sum) once."""

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self._works = works
        self._then = then

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return not self._works and self._then is None


def _finish(exchange: _Exchange, async_op: bool) -> WorkHandle | None:
    if async_op:
        return exchange
    exchange.wait()
    return None


def exchange_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Exchange:
    """All-gather by pairwise send / recv: ``output`` (rank-major) receives
    each rank's ``input`` in its row; see [Note: pairwise exchange on gloo]."""
    size, me = group.size(), group.rank()
    rows = output.view(size, -1)
    if rows.shape[1] != input.numel():
        raise ValueError(f"all-gather output of {output.numel()} elements for {size} ranks of {input.numel()}")
    tag = _next_tag(group)
    works = []
    for peer in _peers(size, me) if input.numel() else []:
        works.append(group.recv([rows[peer]], peer, tag))
        works.append(group.send([input.view(-1)], peer, tag))
    rows[me].copy_(input.view(-1))
    return _Exchange(works)


def exchange_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Exchange:
    """Reduce-scatter (SUM) over two ranks by send / recv: the other rank gets
    its row of ``input``; ``output`` receives this rank's row from it and then
    adds this rank's own row."""
    if group.size() != 2:
        raise ValueError(f"the exchange reduce-scatter is for two ranks, not {group.size()}")
    me = group.rank()
    peer = 1 - me
    rows = input.view(2, -1)
    out = output.view(-1)
    if rows.shape[1] != out.numel():
        raise ValueError(f"reduce-scatter output of {out.numel()} elements for 2 ranks of {input.numel()}")
    tag = _next_tag(group)
    works = [group.recv([out], peer, tag), group.send([rows[peer]], peer, tag)] if out.numel() else []
    return _Exchange(works, lambda: out.add_(rows[me]))


def _peers(size: int, me: int) -> list[int]:
    """The other ranks, starting after this one (so pairs do not all queue on rank 0)."""
    return [(me + k) % size for k in range(1, size)]


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
        return reduce_scatter_tensor(output_tensor, input_tensor, group, op, async_op)
