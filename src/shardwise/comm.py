"""Communication interfaces: how buffers are allocated and how collectives are
issued. The engine's defaults implement the same interfaces, so there is one
code path whether or not a user installs a custom collective."""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

import shardwise.shared_rows as shared_rows

# torch >= 2.13 names them *_single (the *_tensor names warn); older torch has only those.
_AG_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_RS_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
# As imported; looked up again at every call, so that a replacement (PyTorch's
# test utilities patch_all_gather / patch_reduce_scatter assign these
# attributes to count, delay or check collectives) is called as under
# PyTorch's FSDP, and gloo's in-place path stands aside for it.
_ORIGINAL_AG = getattr(dist, _AG_NAME)
_ORIGINAL_RS = getattr(dist, _RS_NAME)

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


def accepts_as(comm: object, kind: type[AllGather] | type[ReduceScatter]) -> bool:
    """Whether ``comm`` can be installed as a ``kind``: one of ours, or one
    written against PyTorch's FSDP interfaces of the same names (any object
    with ``allocate`` that is callable), unless its classes declare it the
    other kind (a reduce-scatter passed as an all-gather, or the reverse)."""
    if isinstance(comm, kind):
        return True
    other = ReduceScatter if kind is AllGather else AllGather
    if other.__name__ in {c.__name__ for c in type(comm).__mro__}:  # ours or PyTorch's other kind
        return False
    return callable(comm) and callable(getattr(comm, "allocate", None))


def all_gather_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> WorkHandle | None:
    """``torch.distributed``'s all-gather into one tensor, under its current name.
    One-byte floats (float8, e.g. torchao's all-gathered weights) travel as
    bytes: gloo has no float8 type, and an all-gather moves bytes unchanged."""
    if input_tensor.dtype.is_floating_point and input_tensor.dtype.itemsize == 1:
        output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
    all_gather = getattr(dist, _AG_NAME)
    # over two ranks always one exchange; over more, one broadcast per rank
    # from _IN_PLACE_MIN_BYTES, or held to travel in a run when small
    held = _together > 0 and _small(input_tensor)
    min_bytes = 0 if group is not None and (group.size() == 2 or held) else _IN_PLACE_MIN_BYTES
    if not held and group is not None and group.size() > 2:
        _send_held(group)  # what is held goes first, as over two ranks
    if all_gather is _ORIGINAL_AG and _in_place_gloo(group, output_tensor, input_tensor, min_bytes):
        return _finish(gloo_all_gather(output_tensor, input_tensor, group), async_op)
    return cast("WorkHandle | None", all_gather(output_tensor, input_tensor, group=group, async_op=async_op))


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> WorkHandle | None:
    """``torch.distributed``'s reduce-scatter into one tensor, under its current name
    (over gloo an all-to-all, see [Note: gloo without its copies])."""
    reduce_scatter = getattr(dist, _RS_NAME)
    if reduce_scatter is _ORIGINAL_RS and op == dist.ReduceOp.SUM and _in_place_gloo(group, output_tensor, input_tensor):
        return _finish(gloo_reduce_scatter(output_tensor, input_tensor, group), async_op)
    return cast("WorkHandle | None",
                reduce_scatter(output=output_tensor, input=input_tensor, op=op, group=group, async_op=async_op))


# [Note: gloo without its copies]
# gloo's all-gather gathers into a flat buffer of its own and copies that into
# the output; its reduce-scatter clones the input, all-reduces the clone and
# copies this rank's chunk out (twice the bytes of a reduce-scatter on the
# wire). On CPU those copies and bytes are CPU time taken from compute. Over a
# gloo group, shardwise's own collectives therefore use gloo collectives that
# read and write the tensors in place, still run by gloo's own threads:
# - over two ranks, each collective is one exchange: an all-to-all that sends
#   the other rank only its part and sends nothing to this rank (split sizes
#   [0, n] / [n, 0]), at every size. The all-gather copies this rank's input
#   into its row of the output and receives the other row in place; the
#   reduce-scatter sends the other rank its row and adds what arrived to its
#   own: the same two numbers gloo adds (a sum of two is the same whichever
#   comes first), so results are gloo's bit for bit;
# - over more ranks, the all-gather copies this rank's input into its row and
#   one broadcast per rank fills that rank's row everywhere (the same bytes
#   as a ring; no flat buffer, no copy back), from 256 KiB per rank (below,
#   gloo's all-gather, or held to travel in a run). The reduce-scatter is
#   one all-to-all that brings this rank every rank's row for it, then a sum
#   in the order gloo's ring sums each element ([Note: gloo's ring order]):
#   the order of a sum of more than two decides its last bits, and any other
#   order would move results off gloo's (and off DDP's) by rounding, which
#   AdamW magnifies on near-zero gradients.
# Timed alone over two ranks on this project's 2-core machine (200 calls,
# 132-264 KiB per rank): the exchange 0.45-0.76 ms a call; gloo's all-gather
# 0.9-1.6 ms, two broadcasts 0.9-1.5 ms, gloo's reduce-scatter 2.7-3.2 ms.
# (Point-to-point send / recv from the training thread was tried first: on a
# loaded CPU, posting a receive waits on the transport's lock while gloo's
# loop thread moves other data, 3 ms per call on the 24-block benchmark.)
# Under a Python dispatch mode (``CommDebugMode``, shardwise's memory tracker,
# fake tensors) the collectives stay gloo's, so whoever counts them sees what
# PyTorch's FSDP issues, and a plan matches its measurement.

# Over more than two ranks, below this many bytes sent per rank, gloo's own
# all-gather. At four ranks on this project's 2 cores the broadcasts were the
# faster at every size tried from 4 KiB to 1.75 MiB per rank but 512 KiB,
# where two rounds split (5.2-5.5 against 6.8-7.0 ms at 896 KiB); in a bf16
# GPT's step (blocks of 896 KiB per rank),
# alternated within one process, 256 KiB against 1 MiB saved 9-37 ms of
# 810-860 ms in each of 3 launches. Below it, small gathers mostly travel in
# runs instead (held, up to _HOLD_MAX_BYTES each).
_IN_PLACE_MIN_BYTES = 256 << 10
_gloo: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()


def _in_place_gloo(
    group: dist.ProcessGroup | None, output: torch.Tensor, input: torch.Tensor, min_bytes: int = 0
) -> bool:
    """Whether a collective of ours over ``group`` takes gloo's in-place path
    (for an ``input`` of at least ``min_bytes``)."""
    if not _is_gloo(group) or output.device.type != "cpu" or not (output.is_contiguous() and input.is_contiguous()):
        return False
    if input.numel() * input.element_size() < min_bytes:
        return False
    return torch._C._len_torch_dispatch_stack() == 0 and not isinstance(output, FakeTensor)


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` of several ranks runs gloo for CPU tensors."""
    if group is None:
        return False
    ok = _gloo.get(group)
    if ok is None:
        try:
            # "gloo", or gloo for CPU tensors in a group of several backends ("cpu:gloo,cuda:nccl")
            backends = str(dist.get_backend(group)).split(",")
            ok = any(b in ("gloo", "cpu:gloo") for b in backends) and group.size() > 1
        except (RuntimeError, ValueError, TypeError):
            ok = False
        _gloo[group] = ok
    return ok


def packs_exchanges(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether a small ``all_gather_tensor`` over ``group`` on ``device`` may
    travel with others ([Note: held-back exchanges]): gloo ranks, CPU tensors,
    ``torch.distributed``'s own all-gather, no dispatch mode. (Fake tensors
    are caught per call, in ``_in_place_gloo``.)"""
    return (
        group is not None and device.type == "cpu" and _is_gloo(group)
        and getattr(dist, _AG_NAME) is _ORIGINAL_AG and torch._C._len_torch_dispatch_stack() == 0
    )


class _Works:
    """Several works in flight as one; ``wait`` completes them, then runs
    ``then`` (the reduce-scatter's sum) once.

    They are issued only outside any dispatch mode (``_in_place_gloo``), and
    what finishing them takes (sending held exchanges, copying packed parts
    out, the sum) runs outside one too, wherever it is waited for: a gather
    the backward prefetched is waited for in a block's pre-forward, which under
    selective activation checkpointing's recompute runs inside its replay
    mode, and that mode refuses any op the forward did not run there."""

    def __init__(self, works: list[Any], then: Callable[[], object] | None = None) -> None:
        self._works = works
        self._then = then

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if torch._C._len_torch_dispatch_stack():
            with _disable_current_modes():
                return self._finish()
        return self._finish()

    def _finish(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        for work in works:
            if isinstance(work, _Parcel):
                work.release()  # what arrived has been read
        return True

    def is_completed(self) -> bool:
        return not self._works and self._then is None


def _finish(works: _Works, async_op: bool) -> WorkHandle | None:
    if async_op:
        return works
    works.wait()
    return None


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Over two ranks: ``send`` to the other rank, and the other rank's (of the
    same size) into ``recv``, as one all-to-all that sends nothing to this rank."""
    n = send.numel()
    other = [0, n] if group.rank() == 0 else [n, 0]
    return dist.all_to_all_single(recv, send, output_split_sizes=other, input_split_sizes=other, group=group,
                                  async_op=True)


# [Note: held-back exchanges]
# Over two gloo ranks most of an exchange's cost is fixed, not per byte: on
# this project's CPU about 0.3 ms a call (issuing, waking gloo's thread,
# waiting: the 24-block benchmark's forward and backward at two ranks less
# at one, over its 74 exchanges), where copying 100 KiB takes 10-20 us. So
# a reduce-scatter's exchange is held back, not sent, until the next
# all-gather over the same group is issued, or until something waits for
# it; then everything held travels with that all-gather as one exchange of
# their bytes (each part aligned, copied in and out of one buffer). In
# backward a group's reduce-scatter is followed at once by the next group's
# prefetch, so this halves backward's exchanges. Forward has nothing held: its all-gathers go
# as before. Only small parts travel together (up to _HOLD_MAX_BYTES each):
# the copies grow with the bytes and the saving does not (at 10-20 us per
# 100 KiB they would match it near 0.5-1 MiB a part), so a large
# reduce-scatter is sent at once, and a large all-gather is sent after (not
# with) whatever is held. Both ranks run the same hooks in the same
# order, so they hold and send the same parts at the same points and each
# exchange has the same size on both sides; a collective of anyone else's
# over the group in between is issued in the same order on both ranks too.
# The bytes moved and the one addition are the same, so results are bit for
# bit those of separate exchanges. A reduce-scatter issued without
# ``async_op`` is waited for at once, so it is sent at once. A packed
# exchange's two byte buffers are reused by the next of the same size once
# every part was read, and dropped when no packed exchange is left in
# flight (the end of a backward), as the engine's pool is.
# Inside ``exchanges_together()`` small all-gathers are held too, and what is
# held goes when the outermost such block ends: the engine issues a run of
# small groups' prefetches there, which then travel as one exchange
# ([Note: prefetch runs] in ``_engine/prefetch.py``).
# Over more than two ranks a reduce-scatter is an all-to-all ([Note: gloo's
# ring order]); small ones (up to _HOLD_MAX_BYTES per rank) are held as over
# two ranks, until the next all-gather over the group is issued or one is
# waited for. What is held goes as at most two collectives: the all-gathers
# (held only inside those blocks) as one gloo all-gather of every part side
# by side (each rank's row holds its part of each), each part's rows copied
# out of it; then the reduce-scatters as one all-to-all of their rows side
# by side, each part's rows from every rank summed in gloo's ring order for
# that part alone. A gather moves bytes unchanged and each sum's order does
# not depend on the packing, so results are the same bit for bit. On this
# project's 2 cores at four ranks, one gloo all-gather of 50 KiB per rank
# took 2.9 ms and one of 250 KiB 3.3 ms (200 calls each); in the 24-block
# model's step, packing the reduce-scatters took about 26 all-to-alls to 6, and
# 479 to 450 ms (alternated within one process).
_ALIGN = 16
_HOLD_MAX_BYTES = 256 << 10
_held: weakref.WeakKeyDictionary[dist.ProcessGroup, list[_Parcel]] = weakref.WeakKeyDictionary()
_together = 0  # depth of exchanges_together() blocks
_gathers_held: list[dist.ProcessGroup] = []  # groups an all-gather was held for inside them


def _small(t: torch.Tensor) -> bool:
    """Whether a part of ``t``'s bytes may be held to travel with others."""
    return t.numel() * t.element_size() <= _HOLD_MAX_BYTES


@contextlib.contextmanager
def exchanges_together() -> Iterator[None]:
    """Hold the small all-gathers issued inside (over gloo); when the outermost
    block ends, send what is held over each group one was held for, as one
    exchange (over more than two ranks, one all-gather, then one all-to-all
    for the reduce-scatters held with them); reduce-scatters held over other
    groups stay held."""
    global _together
    _together += 1
    try:
        yield
    finally:
        _together -= 1
        if not _together:
            groups = list(dict.fromkeys(_gathers_held))
            _gathers_held.clear()
            for group in groups:
                _send_held(group)


class _Flight:
    """A packed exchange's send and receive buffers, shared by its parts."""

    # by (send, receive) bytes, while any flight is live
    spare: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    live = 0

    def __init__(self, nbytes: int, parts: int, received: int) -> None:
        free = _Flight.spare.get((nbytes, received))
        self.buffers = free.pop() if free else (
            torch.empty(nbytes, dtype=torch.uint8), torch.empty(received, dtype=torch.uint8)
        )
        self.left = parts
        _Flight.live += 1

    def part_done(self) -> None:
        self.left -= 1
        if self.left:
            return
        free = _Flight.spare.setdefault((self.buffers[0].numel(), self.buffers[1].numel()), [])
        if len(free) < 4:
            free.append(self.buffers)
        _Flight.live -= 1
        if not _Flight.live:
            _Flight.spare.clear()


class _Parcel:
    """One exchange's payload: ``send`` goes to the other rank, what comes
    back is ``received`` (in ``recv`` when one was given, else wherever it
    landed)."""

    __slots__ = ("group", "send", "recv", "work", "packed", "flight", "done")

    def __init__(self, group: dist.ProcessGroup, send: torch.Tensor, recv: torch.Tensor | None) -> None:
        self.group, self.send, self.recv = group, send, recv
        self.work: Any = None
        self.packed: torch.Tensor | None = None  # its part of a shared receive buffer
        self.flight: _Flight | None = None  # that buffer's exchange, when packed
        self.done = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.work is None:
            _send_held(self.group)
        if not self.done:
            self.work.wait()
            self.done = True
            if self.packed is not None and self.recv is not None:
                self.recv.copy_(self.packed)
                self.packed = None
        return True

    @property
    def received(self) -> torch.Tensor:
        got = self.packed if self.packed is not None else self.recv
        if got is None or not self.done:
            raise RuntimeError("an exchange's data was read before it was waited for (or after it was released)")
        return got

    def release(self) -> None:
        """What arrived has been read: a packed exchange's buffers may serve another."""
        flight, self.flight, self.packed = self.flight, None, None
        if flight is not None:
            flight.part_done()


def _post(group: dist.ProcessGroup, send: torch.Tensor, recv: torch.Tensor | None, hold: bool) -> _Parcel:
    """Queue an exchange over ``group``; send it (with whatever is held) unless
    ``hold``. Over more than two ranks it is a reduce-scatter's all-to-all
    (``send`` its whole input, ``recv`` None)."""
    parcel = _Parcel(group, send.view(-1), None if recv is None else recv.view(-1))
    small = _small(send[0] if group.size() > 2 else send)
    if not small:
        _send_held(group)  # what is held goes first, on its own
    _held.setdefault(group, []).append(parcel)
    if not (hold and small):
        _send_held(group)
    return parcel


def _send_held(group: dist.ProcessGroup) -> None:
    """Send every exchange queued on ``group``: one alone as it is, several as
    one exchange of their bytes; see [Note: held-back exchanges]."""
    parcels = _held.pop(group, [])
    if not parcels:
        return
    if group.size() > 2:
        gathers = [p for p in parcels if p.recv is not None]
        if gathers:
            _send_gathers(group, gathers)
        if len(gathers) < len(parcels):
            _send_scatters(group, [p for p in parcels if p.recv is None])
        return
    if len(parcels) == 1:
        p = parcels[0]
        if p.recv is None:
            p.recv = torch.empty_like(p.send)
        p.work = _exchange(p.send, p.recv, group)
        return
    flight, spans = _pack(parcels, 1)
    send, recv = flight.buffers
    work = _exchange(send, recv, group)
    for p, (start, nbytes) in zip(parcels, spans):
        p.work, p.packed, p.flight = work, recv[start : start + nbytes].view(p.send.dtype), flight


def _pack(parcels: list[_Parcel], ranks: int, rows: int = 1) -> tuple[_Flight, list[tuple[int, int]]]:
    """A flight whose send buffer holds every parcel's bytes side by side (each
    aligned; with ``rows``, each parcel's send cut into that many rows, row i
    of each in row i), receiving ``ranks`` rows as long; and where each one
    starts in a row."""
    spans, total = [], 0
    for p in parcels:
        nbytes = p.send.numel() // rows * p.send.element_size()
        spans.append((total, nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    flight = _Flight(rows * total, len(parcels), ranks * total)
    send = flight.buffers[0].view(rows, total)
    for p, (start, nbytes) in zip(parcels, spans):
        send[:, start : start + nbytes].view(p.send.dtype).copy_(p.send.view(rows, -1))
    return flight, spans


def _send_gathers(group: dist.ProcessGroup, parcels: list[_Parcel]) -> None:
    """Over more than two ranks: the all-gathers held (each parcel's ``recv``
    its whole rank-major output), one alone as it is, several as one
    all-gather of their parts side by side, each part's rows copied out when
    waited for."""
    if len(parcels) == 1:
        p = parcels[0]
        p.work = _ORIGINAL_AG(cast(torch.Tensor, p.recv).view(-1), p.send, group=group, async_op=True)  # its output
        return
    size = group.size()
    flight, spans = _pack(parcels, size)
    send, recv = flight.buffers
    work = _ORIGINAL_AG(recv, send, group=group, async_op=True)
    rows = recv.view(size, -1)
    for p, (start, nbytes) in zip(parcels, spans):
        p.work, p.packed, p.flight = work, rows[:, start : start + nbytes].view(p.send.dtype), flight


def _send_scatters(group: dist.ProcessGroup, parcels: list[_Parcel]) -> None:
    """Over more than two ranks: the reduce-scatters' all-to-alls held (each
    parcel's ``send`` its whole rank-major input), one alone as it is, several
    as one all-to-all of their rows side by side; each parcel receives every
    rank's row for this rank, rank-major."""
    size = group.size()
    if len(parcels) == 1:
        p = parcels[0]
        p.recv = torch.empty_like(p.send)
        p.work = dist.all_to_all_single(p.recv, p.send, group=group, async_op=True)
        return
    flight, spans = _pack(parcels, size, rows=size)
    send, recv = (b.view(size, -1) for b in flight.buffers)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    for p, (start, nbytes) in zip(parcels, spans):
        p.work, p.packed, p.flight = work, recv[:, start : start + nbytes].view(p.send.dtype), flight


def gloo_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Works:
    """All-gather into ``output`` (rank-major): this rank's input copied into
    its row, the others received in place (one exchange over two ranks, with
    any reduce-scatter held back, else one broadcast per rank); see [Note:
    gloo without its copies]. An ``output`` in shared memory has only its
    descriptors exchanged, and the others' rows copied from where they lie
    ([Note: shared rows])."""
    size, me = group.size(), group.rank()
    rows = output.view(size, -1)
    if rows.shape[1] != input.numel():
        raise ValueError(f"all-gather output of {output.numel()} elements for {size} ranks of {input.numel()}")
    if not input.numel():
        return _Works([])
    shared = shared_rows.existing(group)
    desc = None if shared is None else shared.describe(output)
    if shared is not None and desc is not None:
        # [Note: shared rows]: only where each rank's rows lie goes over gloo
        rows[me].copy_(input.view(-1))
        if _together:
            _gathers_held.append(group)
        parcel, every = _descriptors(group, desc, hold=_together > 0)
        ours = shared

        def copy_theirs() -> None:
            descs = ours.check(every)
            for r in range(size):
                if r != me:
                    rows[r].copy_(ours.read(descs[r], rows, r)[r])
            ours.done(descs)

        return _Works([parcel], copy_theirs)
    if size > 2 and _together and _small(input):
        # held to travel with the others of a run; every row is copied out
        parcel = _Parcel(group, input.view(-1), rows)
        _held.setdefault(group, []).append(parcel)
        _gathers_held.append(group)
        return _Works([parcel])
    rows[me].copy_(input.view(-1))
    if size == 2:
        if _together:
            _gathers_held.append(group)
        return _Works([_post(group, input, rows[1 - me], hold=_together > 0)])
    return _Works([dist.broadcast(rows[r], group=group, group_src=r, async_op=True) for r in range(size)])


def _descriptors(group: dist.ProcessGroup, desc: torch.Tensor, hold: bool) -> tuple[_Parcel, torch.Tensor]:
    """Every rank's shared-buffer descriptor, rank-major (this rank's as
    given), over gloo as one small exchange or gather, held as ``hold`` says
    ([Note: held-back exchanges], [Note: shared rows])."""
    size, me = group.size(), group.rank()
    every = torch.empty(size, desc.numel(), dtype=desc.dtype)
    every[me] = desc
    if size == 2:
        return _post(group, desc, every[1 - me], hold), every
    parcel = _Parcel(group, desc, every)
    _held.setdefault(group, []).append(parcel)
    if not hold:
        _send_held(group)
    return parcel, every


def gloo_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Works:
    """Reduce-scatter (SUM) into ``output``, gloo's bits; see [Note: gloo
    without its copies]. Over two ranks one exchange (held back for the next
    all-gather, [Note: held-back exchanges]) sends the other rank its row, and
    this rank's row plus what arrived goes into ``output``. Over more, one
    all-to-all brings every rank's row for this rank, summed as gloo's ring
    sums them ([Note: gloo's ring order]). An ``input`` in shared memory has
    only its descriptors exchanged, and the others' rows for this rank are
    summed where they lie, in the same order ([Note: shared rows])."""
    size, me = group.size(), group.rank()
    out = output.view(-1)
    if size * out.numel() != input.numel():
        raise ValueError(f"reduce-scatter output of {out.numel()} elements for {size} ranks of {input.numel()}")
    if not out.numel():
        return _Works([])
    rows = input.view(size, -1)
    shared = shared_rows.existing(group)
    desc = None if shared is None else shared.describe(input)
    if shared is not None and desc is not None:
        # [Note: shared rows]: every rank's row for this rank, read where it
        # lies, summed as below (the same additions in the same order)
        parcel, every = _descriptors(group, desc, hold=True)
        ours = shared

        def sum_theirs() -> None:
            descs = ours.check(every)
            parts = [rows[me] if r == me else ours.read(descs[r], rows, r)[me] for r in range(size)]
            if size == 2:
                torch.add(parts[me], parts[1 - me], out=out)
            else:
                ring_sum(parts, me, out)
            ours.done(descs)

        return _Works([parcel], sum_theirs)
    if size == 2:
        parcel = _post(group, rows[1 - me], None, hold=True)
        return _Works([parcel], lambda: torch.add(rows[me], parcel.received, out=out))
    parcel = _post(group, rows, None, hold=True)
    return _Works([parcel], lambda: ring_sum(parcel.received.view(size, -1), me, out))


# [Note: gloo's ring order]
# gloo's reduce-scatter over more than two ranks is its ring all-reduce of a
# copy of the input (gloo/allreduce.cc in the gloo that torch 2.13 builds).
# The ring cuts the buffer into one chunk per rank (not the reduce-scatter's
# rows: chunks are whole segments, so their edges fall a few elements off the
# rows'), and chunk c's sum starts at rank c-1 and travels down the ring:
# x[c-1] + x[c-2] + ... + x[c+1], then rank c adds its own. Floating-point
# sums depend on their order, so this order is what gives gloo's (and DDP's,
# and PyTorch's FSDP's) last bits. ``ring_sum`` adds the rows in that order,
# chunk by chunk, so an all-to-all (each rank sends each other rank only its
# row: half the bytes of the ring all-reduce) plus that sum gives the same
# bits. Segments: at most 1 MiB each, as many as that needs but at least two
# per rank and a multiple of the ranks, all of one size (rounded up to whole
# elements). Tested against gloo's own reduce-scatter over 3 and 4 ranks,
# fp32 and bf16, 1 to 2.5 million elements per rank (one to ten segments
# per rank; ``test_reduce_scatter_sums_in_gloos_ring_order``); a gloo that
# cut its ring otherwise would fail that test, not train a few ulps off.
_RING_SEGMENT_BYTES = 1 << 20


def ring_chunk(numel: int, itemsize: int, ranks: int) -> int:
    """Elements in each chunk of gloo's ring all-reduce of ``numel`` elements
    of ``itemsize`` bytes over ``ranks`` ranks (the last may be short)."""
    total = numel * itemsize
    most = itemsize * max(1, _RING_SEGMENT_BYTES // itemsize)
    segments = -(-max(-(-total // most), 2 * ranks) // ranks) * ranks
    segment = -(-total // segments)
    segment = -(-segment // itemsize) * itemsize
    return segments // ranks * segment // itemsize


def ring_sum(rows: torch.Tensor | Sequence[torch.Tensor], rank: int, out: torch.Tensor) -> None:
    """``out`` = the sum of ``rows`` (every rank's row for ``rank``, rank-major:
    a [ranks, n] tensor or ranks tensors of n), each element summed in the
    order gloo's ring sums it ([Note: gloo's ring order])."""
    size, n = len(rows), rows[0].numel()
    chunk = ring_chunk(size * n, rows[0].element_size(), size)
    start = rank * n
    while start < (rank + 1) * n:
        c = start // chunk
        end = min((c + 1) * chunk, (rank + 1) * n)
        a, b = start - rank * n, end - rank * n
        part = out[a:b]
        torch.add(rows[(c - 1) % size][a:b], rows[(c - 2) % size][a:b], out=part)
        for k in range(3, size):
            part.add_(rows[(c - k) % size][a:b])
        part.add_(rows[c % size][a:b])
        start = end


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
