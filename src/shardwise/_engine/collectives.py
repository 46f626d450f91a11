"""Grouped collectives: one all-gather of a whole group's shards (copy-in,
collective, copy-out) and one reduce-scatter of its gradients. Every collective
goes through the group's ``Comm`` call, so the default path and a user's custom
collective are one code path; buffers come from a custom comm's ``allocate``,
or, for ours, from a :class:`BufferPool` shared by the groups under one root.

[Note: reused buffers]
A step gathers and reduces every group in turn, and groups of one model are
mostly alike (N identical blocks), so the same few buffer sizes are asked for
again and again. The pool keeps buffers that a finished collective no longer
needs (all-gather outputs once copied out, cast all-gather inputs and
reduce-scatter inputs once the collective completed) and hands them to the
next collective of the same size, dtype and device: no allocator churn, no
fresh pages to fault in, and resident memory stays at what is live at the
peak. Reduce-scatter outputs are never pooled: gradients are views of them.
The pool is emptied when the backward ends: buffers kept from one step to the
next would sit idle through the optimizer step and the next forward (at a
405B model on 16,384 ranks, ``shardwise plan`` counted 70 GiB of them per
rank), where an allocator could have reused their memory for anything; and
it keeps at most two buffers of a size (more were never taken again).
Within the backward, idle buffers of the blocks' sizes still stand while the
root (of another size) reduces: with activation checkpointing they are most
of that model's planned peak, a known cost of exact-size pooling (freeing
them on a miss was tried and raised the plan's peak elsewhere; left open).
The pool keeps CPU buffers only. On CUDA the caching allocator already hands
a freed block to the next request of its size, without a system call, and
can split it for smaller ones meanwhile, while a pooled buffer sits idle and
counts in ``torch.cuda.max_memory_allocated``: pooling there measured 114 MiB
(1.3%) above PyTorch's peak on an H200 at world size 1 (the root's and two
blocks' bf16 casts), and without it the step time stayed within noise. The
planner's fake run, on CPU tensors, plans a CUDA step without the pool
(:func:`pool_as_on`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

import shardwise.shared_rows as shared_rows
from shardwise.comm import (
    AllGather,
    Comm,
    DefaultAllGather,
    DefaultReduceScatter,
    ReduceScatter,
    WorkHandle,
    packs_exchanges,
)
from shardwise.errors import CollectiveError
from shardwise.layout import FlatLayout

T = TypeVar("T")


# The device type whose pooling the pool follows, where not the buffers' own
# (the planner's fake run of a CUDA step, on CPU tensors); see pool_as_on.
_pool_as: str | None = None


@contextmanager
def pool_as_on(device_type: str) -> Iterator[None]:
    """Within the block, every pool keeps buffers (or not) as it would on
    ``device_type``, whatever device they are on: the planner runs a CUDA
    step on fake CPU tensors ([Note: reused buffers])."""
    global _pool_as
    before, _pool_as = _pool_as, device_type
    try:
        yield
    finally:
        _pool_as = before


def _pools(device: torch.device) -> bool:
    return (_pool_as or device.type) == "cpu"


class BufferPool:
    """Free communication buffers by (numel, dtype, device); see [Note: reused
    buffers]. At most ``keep`` are kept per key, and only CPU buffers."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        with torch.inference_mode(False):  # reused outside inference mode too
            return torch.empty(numel, dtype=dtype, device=device)

    def give(self, *buffers: torch.Tensor) -> None:
        for t in buffers:
            if not _pools(t.device) or shared_rows.give(t):
                continue
            free = self._free.setdefault((t.numel(), t.dtype, t.device), [])
            if len(free) < self.keep:
                free.append(t)

    def clear(self) -> None:
        self._free.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)


class AllGatherResult(NamedTuple):
    """An all-gather in flight."""

    output: torch.Tensor  # [num_shards * total], rank-major
    work: WorkHandle | None
    input: torch.Tensor  # kept alive until the collective completes
    post_forward: bool  # gathered over the post-forward subgroup
    flat: FlatLayout  # how each parameter sits in a row of ``output``
    pooled: tuple[torch.Tensor, ...]  # buffers to give back once copied out


class PackedGatherResult(NamedTuple):
    """An all-gather of tensors of several dtypes (or from all-gather
    extensions) in flight: one collective, over one buffer of their common
    dtype or, when dtypes differ, of bytes."""

    output: torch.Tensor  # [num_shards, row] in the buffer's dtype
    work: WorkHandle | None
    input: torch.Tensor
    offsets: list[int]  # where each input starts in a row, in buffer elements
    numels: list[int]  # each input's elements
    dtypes: list[torch.dtype]


class ReduceScatterResult(NamedTuple):
    """A gradient reduce-scatter in flight."""

    output: torch.Tensor  # this rank's reduced padded shards, concatenated
    work: WorkHandle | None
    input: torch.Tensor
    flat: FlatLayout  # where each gradient's shard sits in ``output``
    pooled: tuple[torch.Tensor, ...]  # buffers to give back once it completed


# [Note: gathers outside selective checkpointing]
# Selective activation checkpointing records every op its region's forward
# runs (``_CachingTorchDispatchMode``) and, in the recompute, refuses any op
# it did not see there, by op and count (``_CachedTorchDispatchMode``). Where
# a group is gathered depends on prefetching: in a forward, a block inside
# the region may have been gathered outside it (the root's prefetch, or a
# run of small groups), while in the recompute, which the backward can reach
# before that block's pre-backward, the same block is gathered inside it. So
# a group's unshard in its pre-forward (issuing, waiting, copying out) runs
# outside those two modes, as none of it is the region's computation. Only
# those modes are set aside, and only while they are innermost: a mode
# around the region (``CommDebugMode`` counting collectives) still sees
# every collective. PyTorch's FSDP issues its gathers inside the region, one
# group ahead, and trains the case that failed here before
# (``test_selective_checkpointing_recomputes_before_the_blocks_pre_backward``).
_CHECKPOINT_MODES = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
_NO_MODES = contextlib.nullcontext()


def outside_checkpoint_modes() -> contextlib.AbstractContextManager[object]:
    """Set aside selective checkpointing's innermost dispatch modes, if any,
    until the block ends ([Note: gathers outside selective checkpointing])."""
    if not torch._C._len_torch_dispatch_stack():
        return _NO_MODES  # the usual case, on every pre-forward
    stack = contextlib.ExitStack()
    while (modes := _get_current_dispatch_mode_stack()) and type(modes[-1]).__name__ in _CHECKPOINT_MODES:
        stack.enter_context(_pop_mode_temporarily())
    return stack


def is_default(comm: Comm) -> bool:
    """Whether ``comm`` is ours (fresh buffers per call, so results may alias them)."""
    return type(comm) in (DefaultAllGather, DefaultReduceScatter)


# Set on an exception that _guard passes on unchanged.
RAISE_AS_IS = "_shardwise_raise_as_is"


def _guard(where: str, hook: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:  # a collective (ours or a user's) raised: say where and which
        if getattr(exc, RAISE_AS_IS, False):  # e.g. an FSDP1 comm hook's own error, as FSDP1 raises it
            raise
        raise CollectiveError(f"{where}: the {hook} raised {type(exc).__name__}: {exc}") from exc


def allocate(
    comm: Comm, numel: int, dtype: torch.dtype, device: torch.device, where: str, hook: str
) -> torch.Tensor:
    """A 1-D buffer from ``comm.allocate``, checked."""
    buf = _guard(where, f"{hook}.allocate", lambda: comm.allocate((numel,), dtype=dtype, device=device))
    if not isinstance(buf, torch.Tensor):
        raise CollectiveError(f"{where}: {hook}.allocate returned {type(buf).__name__}, not a Tensor")
    if buf.numel() != numel or buf.dtype != dtype or buf.device != device or not buf.is_contiguous():
        raise CollectiveError(
            f"{where}: {hook}.allocate((numel={numel},), dtype={dtype}, device={device}) returned "
            f"a tensor of shape {tuple(buf.shape)}, dtype {buf.dtype}, device {buf.device}"
            f"{'' if buf.is_contiguous() else ', not contiguous'}; it must return exactly "
            "what was asked for."
        )
    return buf.view(-1)


def _group_size(group: dist.ProcessGroup) -> int:
    return int(group.size())


def communicates(comm: Comm, group: dist.ProcessGroup) -> bool:
    """Whether a collective must be issued: a one-rank shard group with our own
    collectives needs none (NO_SHARD, HSDP with shard size 1), as in PyTorch."""
    return not (is_default(comm) and _group_size(group) == 1)


# Byte offsets of packed inputs are aligned so that each can be viewed in its dtype.
_ALIGN = 16


def start_packed_all_gather(
    comm: AllGather,
    inputs: Sequence[torch.Tensor],
    num_shards: int,
    group: dist.ProcessGroup,
    device: torch.device,
    where: str,
) -> PackedGatherResult:
    """Issue one all-gather of 1-D ``inputs`` that may differ in dtype: copied
    into one buffer (of bytes when dtypes differ), gathered rank-major."""
    dtypes = [t.dtype for t in inputs]
    numels = [t.numel() for t in inputs]
    packed = len(set(dtypes)) > 1
    buf_dtype = torch.uint8 if packed else dtypes[0]
    offs, acc = [], 0
    for t in inputs:
        offs.append(acc)
        size = t.numel() * t.element_size() if packed else t.numel()
        acc += -(-size // _ALIGN) * _ALIGN if packed else size
    total = acc
    if is_default(comm):
        # Ours: input and output apart (gloo gathers an input inside its
        # output through copies of its own, which a plan would not see).
        inp = out = allocate(comm, total, buf_dtype, device, where, "AllGather")
        if communicates(comm, group):
            out = allocate(comm, num_shards * total, buf_dtype, device, where, "AllGather")
    else:
        out, inp = _gather_buffers(comm, group, num_shards, total, buf_dtype, device, where)
    for t, a, n in zip(inputs, offs, numels):
        src = t.reshape(-1)
        if packed:
            src = src.contiguous().view(torch.uint8)
        inp[a : a + src.numel()].copy_(src, non_blocking=True)
    if communicates(comm, group):
        work = _guard(where, "AllGather", lambda: comm(out, inp, group, True))
    else:
        work = None
    return PackedGatherResult(out.view(num_shards, total), work, inp, offs, numels, dtypes)


def _gather_buffers(
    comm: AllGather, group: dist.ProcessGroup, num_shards: int, total: int, dtype: torch.dtype,
    device: torch.device, where: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-gather's output from ``comm.allocate`` (one call) and its input:
    this rank's row of the output, gathered in place, as PyTorch's FSDP does
    (a custom comm sees the same one allocation per all-gather there)."""
    out = allocate(comm, num_shards * total, dtype, device, where, "AllGather")
    if not communicates(comm, group):
        return out, out
    return out, out.view(num_shards, total)[group.rank()]


def finish_packed_all_gather(result: PackedGatherResult, where: str) -> list[torch.Tensor]:
    """Wait, then each input's gathered data as a [num_shards, numel] view."""
    if result.work is not None:
        _guard(where, "AllGather work", result.work.wait)
    out = result.output
    packed = out.dtype == torch.uint8 and any(d != torch.uint8 for d in result.dtypes)
    views = []
    for a, n, dtype in zip(result.offsets, result.numels, result.dtypes):
        if packed:
            views.append(out[:, a : a + n * dtype.itemsize].view(dtype))
        else:
            views.append(out[:, a : a + n])
    return views


def _buffer(
    comm: Comm, pool: BufferPool | None, numel: int, dtype: torch.dtype, device: torch.device, where: str, hook: str,
    exchanged_over: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A 1-D buffer: from the pool for our own comms (in shared memory when its
    rows are exchanged over a group that shares them, [Note: shared rows]),
    else from ``comm.allocate``; with what to give back to the pool."""
    if pool is not None and is_default(comm):
        if exchanged_over is not None and _shares_rows(exchanged_over, numel * dtype.itemsize, device):
            rows = shared_rows.for_group(exchanged_over)
            if rows is not None:
                buf = rows.take(numel * dtype.itemsize).view(dtype)
                return buf, (buf,)
        buf = pool.take(numel, dtype, device)
        return buf, (buf,)
    return allocate(comm, numel, dtype, device, where, hook), ()


def _shares_rows(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> bool:
    return (
        nbytes >= shared_rows.MIN_BYTES and shared_rows.requested()
        and packs_exchanges(group, device) and not torch.compiler.is_compiling()
    )


def start_all_gather(
    comm: AllGather,
    flat_source: torch.Tensor,
    flat: FlatLayout,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    where: str,
    post_forward: bool,
    pool: BufferPool | None = None,
) -> AllGatherResult:
    """Issue one all-gather of ``flat_source``: every shard of a group, padded
    and back to back as ``flat`` lays them out. Ours sends it as is (no
    copy-in) or cast into a pooled buffer in one op; a custom comm allocates
    the output and gets a copy in this rank's row of it.
    """
    total = flat.total
    if not is_default(comm):
        out, inp = _gather_buffers(comm, group, flat.num_shards, total, dtype, device, where)
        inp.copy_(flat_source)
        work = _guard(where, "AllGather", lambda: comm(out, inp, group, True))
        return AllGatherResult(out, work, inp, post_forward, flat, ())
    inp = flat_source
    pooled: tuple[torch.Tensor, ...] = ()
    if inp.device != device or inp.dtype != dtype:
        inp, pooled = _buffer(comm, pool, total, dtype, device, where, "AllGather")
        inp.copy_(flat_source, non_blocking=True)
    if communicates(comm, group):
        out, more = _buffer(comm, pool, flat.num_shards * total, dtype, device, where, "AllGather", group)
        pooled += more
        work = _guard(where, "AllGather", lambda: comm(out, inp, group, True))
    else:
        out, work = inp, None
    return AllGatherResult(out, work, inp, post_forward, flat, pooled)


def finish_all_gather(
    result: AllGatherResult, fulls: Sequence[torch.Tensor], where: str, pool: BufferPool | None = None
) -> None:
    """Wait for the all-gather and copy each parameter out of the rank-major
    buffer; then give the pooled buffers back."""
    if result.work is not None:
        _guard(where, "AllGather work", result.work.wait)
    _copy_out(result, fulls)
    if pool is not None and result.pooled:
        pool.give(*result.pooled)


def _copy_out(result: AllGatherResult, fulls: Sequence[torch.Tensor]) -> None:
    flat = result.flat
    layouts, offs, num_shards = flat.layouts, flat.offsets, flat.num_shards
    gathered = result.output.view(num_shards, -1)
    if flat.dim0:
        # [Note: fused copies] One op splits the buffer into per-parameter
        # views, one foreach copy fills every parameter whose rows divide
        # evenly (its [num_shards, chunk numel] view is exactly its part of
        # each rank's row); only uneven ones take their own (two) copies.
        pieces = torch.split_with_sizes(gathered, flat.sizes, dim=1)
        dsts, srcs = [], []
        for full, piece, layout in zip(fulls, pieces, layouts):
            if layout.chunk == 0:
                continue
            if layout.even and full.is_contiguous():
                dsts.append(full.view(num_shards, -1))
                srcs.append(piece)
            else:
                layout.gather_into(full, piece.view(num_shards, *layout.padded_shape))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return
    for full, start, end, layout in zip(fulls, offs, offs[1:], layouts):
        layout.gather_into(full, gathered[:, start:end].view(num_shards, *layout.padded_shape))


def start_reduce_scatter(
    comm: ReduceScatter,
    grads: Sequence[torch.Tensor],
    flat: FlatLayout,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    predivide: float,
    where: str,
    pool: BufferPool | None = None,
) -> ReduceScatterResult:
    """Issue one reduce-scatter (SUM) of every gradient (laid out as ``flat``:
    one entry per gradient), rank-major."""
    layouts, offs, total, num_shards = flat.layouts, flat.offsets, flat.total, flat.num_shards
    talks = communicates(comm, group)
    # Without communication the input is the output, which gradients view: not pooled.
    inp, pooled = _buffer(
        comm, pool if talks else None, num_shards * total, dtype, device, where, "ReduceScatter", group
    )
    rows = inp.view(num_shards, total)
    if flat.chunk_cat:
        # [Note: fused copies]: one op pads every gradient's rows to a multiple
        # of num_shards and lays the chunks out rank-major (torch.chunk's cut,
        # the padding zeroed), as PyTorch's FSDP does; gradients in another
        # dtype are cast first, as there, unless nothing is padded: then each
        # gradient is cast as it is copied into its [num_shards, n] part of
        # the rows (one pass, no copy of each gradient in the reduce dtype).
        # Under a Python dispatch mode (the planner's fake execution, its
        # memory tracker) the copy-in stays PyTorch's, so plan and measurement
        # agree; the plan is then an upper bound by that one copy.
        if (flat.even and torch._C._len_torch_dispatch_stack() == 0 and any(g.dtype != dtype for g in grads)
                and all(g.is_contiguous() for g in grads)):
            for piece, g in zip(torch.split_with_sizes(rows, flat.sizes, dim=1), grads):
                piece.copy_(g.view(num_shards, -1))
        else:
            torch._chunk_cat([g if g.dtype == dtype else g.to(dtype) for g in grads], 0, num_shards, out=rows)
    else:
        for grad, start, end, layout in zip(grads, offs, offs[1:], layouts):
            layout.scatter_from(grad, rows[:, start:end].view(num_shards, *layout.padded_shape))
    if predivide != 1.0:
        inp.div_(predivide)
    if not talks:
        return ReduceScatterResult(inp, None, inp, flat, ())
    out = allocate(comm, total, dtype, device, where, "ReduceScatter")
    work = _guard(where, "ReduceScatter", lambda: comm(out, inp, group, dist.ReduceOp.SUM, True))
    return ReduceScatterResult(out, work, inp, flat, pooled)
