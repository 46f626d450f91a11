"""Live tensor memory of a training step, by category, over real or fake
tensors; and the bytes each collective moves.

[Note: how the memory tracker counts]
A ``TorchDispatchMode`` sees every operator; each storage an operator's
outputs live in (a subclass such as DTensor flattened to its inner tensors)
is registered the first time it is seen, with its size, and a weak
reference whose callback records its release. The engine resizes the
storage of unsharded parameters in place (``shardwise.observe`` tells the
tracker) and says which region it is in (all-gather, copy-out,
reduce-scatter, ...). Every allocation, resize and release is one event;
nothing is summed while the step runs.

When a step ends (after the optimizer step, before ``zero_grad``) the
tracker looks at what the model and optimizer hold: the storages of the
sharded parameters, of the gradients and of the optimizer state. Every
storage then gets one category, in this order: sharded parameters, module
buffers, gradients (held by ``.grad``, or handed to the reduce-scatter by the
engine, or accumulated unsharded between micro-steps), optimizer state;
then by where it was made: all-gather and reduce-scatter staging are
communication buffers, all-gather copy-out and the post-forward reshard make
unsharded parameters; then by phase: made in forward (or the batch) and still
alive when forward ends is an activation; anything else (forward scratch
freed in forward, backward's scratch and recomputation, the optimizer's
scratch) is a temporary. Replaying the events with those categories gives
the live bytes per category at every event, the peak (the most live bytes
at once, pre-existing tensors included) and what made it up.

The same tracker over real tensors is the measurement the planner's fake
run is checked against (``tests/dist/test_planner_simulate.py``).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

import shardwise.observe as observe

__all__ = ["CATEGORIES", "COLLECTIVES", "MemoryTracker", "StepMemory", "TimelinePoint"]

CATEGORIES = (
    "sharded_params",
    "gradients",
    "optimizer_state",
    "unsharded_params",
    "activations",
    "comm_buffers",
    "temporaries",
    "buffers",
)
"""The categories of live memory, in report order (``buffers``: module buffers)."""

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "other")
"""Kinds of collective counted in ``comm_bytes``."""

_REGION_CATEGORY = {
    "all_gather": "comm_buffers",
    "reduce_scatter": "comm_buffers",
    "all_gather_copy_out": "unsharded_params",
    "reshard_post_forward": "unsharded_params",
    "post_backward": "gradients",
}


def _collective_table() -> dict[Any, tuple[str, str]]:
    """op -> (kind, how its bytes are counted): ``out`` the first argument
    (the gathered output, all of it, own shard included), ``in`` the second
    argument (the whole input each rank contributes), ``arg`` the first
    argument (all-reduce, broadcast), ``gathered`` the first argument times the
    group size (functional all-gather)."""
    c10d = torch.ops.c10d
    table: dict[Any, tuple[str, str]] = {}

    def add(ns: Any, name: str, kind: str, how: str) -> None:
        op = getattr(ns, name, None)
        if op is not None:
            table[op.default] = (kind, how)

    add(c10d, "_allgather_base_", "all_gather", "out")
    add(c10d, "allgather_", "all_gather", "out")
    add(c10d, "allgather_into_tensor_coalesced_", "all_gather", "out")
    add(c10d, "_reduce_scatter_base_", "reduce_scatter", "in")
    add(c10d, "reduce_scatter_", "reduce_scatter", "in")
    add(c10d, "reduce_scatter_tensor_coalesced_", "reduce_scatter", "in")
    add(c10d, "allreduce_", "all_reduce", "arg")
    add(c10d, "allreduce_coalesced_", "all_reduce", "arg")
    add(c10d, "broadcast_", "other", "arg")
    add(c10d, "alltoall_base_", "other", "arg")
    fn = torch.ops._c10d_functional
    add(fn, "all_reduce", "all_reduce", "arg")
    add(fn, "all_reduce_", "all_reduce", "arg")
    add(fn, "all_reduce_coalesced", "all_reduce", "arg")
    add(fn, "all_gather_into_tensor", "all_gather", "gathered")
    add(fn, "all_gather_into_tensor_out", "all_gather", "gathered")
    add(fn, "reduce_scatter_tensor", "reduce_scatter", "arg")
    add(fn, "broadcast", "other", "arg")
    add(fn, "all_to_all_single", "other", "arg")
    return table


def _is_fake(t: torch.Tensor) -> bool:
    if is_traceable_wrapper_subclass(t):
        return t.device.type != "meta"  # a wrapper over fake tensors reports the fake device
    return isinstance(t, FakeTensor)


def _nbytes(obj: Any) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if t.layout is not torch.strided:
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - tensors without storage
        return


@dataclass(frozen=True)
class TimelinePoint:
    """Live bytes at one moment of a step: ``label`` is the phase or the
    engine region entered (``"all_gather (layers.3)"``)."""

    label: str
    live_bytes: int


@dataclass
class StepMemory:
    """What :class:`MemoryTracker` measured over the steps it tracked."""

    peak_bytes: int  # most live tensor bytes at once during a tracked step
    by_category: dict[str, int]  # live bytes per category at that moment
    peak_at: str  # the phase / region in which the peak happened
    timeline: list[TimelinePoint]  # the last tracked step, at each phase change and region entry
    comm_bytes_per_step: dict[str, int]  # bytes per collective kind, per tracked step (the last)
    collectives_per_step: dict[str, int] = field(default_factory=dict)  # calls per kind, the last step
    end_by_category: dict[str, int] = field(default_factory=dict)  # live at the last step's end (before zero_grad)


class _Step:
    def __init__(self, first_event: int) -> None:
        self.first_event = first_event
        self.last_event = first_event
        self.comm: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self.calls: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self.marks: list[tuple[int, str]] = []  # (event index, label)


class MemoryTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Tracks live tensor memory by category through training steps, over
    real or fake tensors; see [Note: how the memory tracker counts].

    Use::

        tracker = MemoryTracker(model, optimizer)   # after the model is built and sharded
        with tracker:
            for _ in range(2):
                with tracker.step():
                    tracker.phase("forward"); loss = loss_fn(model(x), y)
                    tracker.phase("backward"); loss.backward()
                    tracker.phase("optimizer"); optimizer.step()
                optimizer.zero_grad()
        report = tracker.result()

    Args:
        model: the (sharded) model; its parameters and buffers are tracked from the start.
        optimizer: its state is categorised at the end of each step. (Default: ``None``)
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.model = model
        self.optimizer = optimizer
        self._collectives = _collective_table()
        self._seq_of: dict[int, int] = {}  # storage _cdata -> sequence number
        self._alias_of: dict[int, int] = {}  # storage _cdata -> the tracked storage whose memory it shares
        self._spans: list[tuple[int, float, int]] = []  # sorted (start, end, seq) of live real storages
        self._span_of: dict[int, tuple[int, float, int]] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # seq -> its storage
        self._size: dict[int, int] = {}  # seq -> current bytes
        self._made: dict[int, tuple[str, str | None, int]] = {}  # seq -> (phase, region kind, event index)
        self._freed: dict[int, int] = {}  # seq -> event index of its release
        self._fixed: dict[int, str] = {}  # seq -> category known from what holds it
        self._tags: dict[int, str] = {}  # seq -> category the engine told
        self._events_seq: list[int] = []
        self._events_delta: list[int] = []
        self._next = 0
        self._phase = "setup"
        self._phase_start: dict[str, int] = {}
        self._forward_ends: list[tuple[int, int]] = []  # (start, end) event indices of forward phases
        self._regions: list[str] = []
        self._steps: list[_Step] = []
        self._current: _Step | None = None
        if model is not None:
            self.watch(model, optimizer)

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Categorise what ``model`` and ``optimizer`` hold at the end of each
        step (a tracker entered before the model was sharded, to see its
        buffers made, is told the model here)."""
        self.model = model
        self.optimizer = optimizer
        for t in [*model.parameters(), *model.buffers()]:
            self._see(t)

    # ---- the dispatch mode ---------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        entry = self._collectives.get(func)
        if entry is not None and self._current is not None:
            kind, how = entry
            if how == "out":
                moved = _nbytes(args[0])
            elif how == "in":
                moved = _nbytes(args[1])
            elif how == "gathered":
                moved = _nbytes(args[0]) * int(args[1])
            else:
                moved = _nbytes(args[0])
            self._current.comm[kind] += moved
            self._current.calls[kind] += 1
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out

    def __enter__(self) -> MemoryTracker:
        observe.register(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        observe.unregister(self)

    # ---- storages ------------------------------------------------------------
    def _see(self, t: torch.Tensor) -> None:
        for storage in _storages(t):
            if storage.device.type == "meta" and not _is_fake(t):
                continue  # a meta tensor: no memory
            self._see_storage(storage)

    def _see_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._seq_of and key not in self._alias_of:
            base = self._aliased(storage)
            if base is not None:
                self._alias_of[key] = base
                weakref.finalize(storage, self._alias_of.pop, key, None)
                return
            seq = self._next
            self._next += 1
            self._seq_of[key] = seq
            self._refs[seq] = weakref.ref(storage, self._release_callback(key, seq))
            nbytes = storage.nbytes()
            self._size[seq] = nbytes
            region = self._regions[-1] if self._regions else None
            self._made[seq] = (self._phase, region, len(self._events_seq))
            self._event(seq, nbytes)
            self._place(seq, storage)

    # Real storages may share memory: a shard re-wrapped through DLPack has a
    # storage of its own over the flat buffer's memory. Such a storage lies
    # inside a tracked one's address range and is not counted again. Fake
    # storages (device "meta") have no addresses and never alias this way.
    def _unplace(self, seq: int) -> None:
        old = self._span_of.pop(seq, None)
        if old is not None:
            at = bisect.bisect_left(self._spans, old)
            if at < len(self._spans) and self._spans[at] == old:
                del self._spans[at]

    def _place(self, seq: int, storage: torch.UntypedStorage) -> None:
        self._unplace(seq)
        if storage.device.type == "meta" or storage.nbytes() == 0:
            return
        start = storage.data_ptr()
        span = (start, start + storage.nbytes(), seq)
        bisect.insort(self._spans, span)
        self._span_of[seq] = span

    def _aliased(self, storage: torch.UntypedStorage) -> int | None:
        """The tracked storage whose memory ``storage`` lies in, if any."""
        if storage.device.type == "meta" or storage.nbytes() == 0 or not self._spans:
            return None
        start = storage.data_ptr()
        at = bisect.bisect_right(self._spans, (start, float("inf"), 0)) - 1
        if at >= 0 and self._spans[at][0] <= start and start + storage.nbytes() <= self._spans[at][1]:
            return self._spans[at][2]
        return None

    def _release_callback(self, key: int, seq: int) -> Any:
        def released(_: object) -> None:
            if self._seq_of.get(key) == seq:
                del self._seq_of[key]
            self._unplace(seq)
            self._freed[seq] = len(self._events_seq)
            self._event(seq, -self._size[seq])
            self._size[seq] = 0

        return released

    def _event(self, seq: int, delta: int) -> None:
        if delta:
            self._events_seq.append(seq)
            self._events_delta.append(delta)

    def _seq(self, storage: torch.UntypedStorage) -> int | None:
        key = storage._cdata
        seq = self._seq_of.get(key)
        return seq if seq is not None else self._alias_of.get(key)

    # ---- the engine's events (shardwise.observe) ------------------------------
    def enter_region(self, kind: str, name: str) -> None:
        """See :class:`shardwise.observe.Observer`."""
        self._regions.append(kind)
        if self._current is not None:
            self._current.marks.append((len(self._events_seq), f"{kind} ({name})"))

    def exit_region(self) -> None:
        """See :class:`shardwise.observe.Observer`."""
        if self._regions:
            self._regions.pop()

    def storage_resized(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        """See :class:`shardwise.observe.Observer`."""
        seq = self._seq(storage)
        if seq is None:
            self._see_storage(storage)
            return
        if storage._cdata in self._alias_of:
            return
        new = storage.nbytes()
        self._event(seq, new - self._size[seq])
        self._size[seq] = new
        self._place(seq, storage)

    def tag(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        """Record that ``tensors`` hold ``category`` (e.g. the engine's
        unsharded gradients); see :func:`shardwise.observe.tag`."""
        for t in tensors:
            self._see(t)
            for storage in _storages(t):
                seq = self._seq(storage)
                if seq is not None:
                    self._tags.setdefault(seq, category)

    # ---- steps and phases ----------------------------------------------------
    def phase(self, name: str) -> None:
        """Enter phase ``name`` of the step: ``"batch"``, ``"forward"``,
        ``"backward"`` or ``"optimizer"`` (see the note for what each decides)."""
        now = len(self._events_seq)
        if self._phase == "forward":
            self._forward_ends.append((self._phase_start.get("forward", now), now))
        self._phase = name
        self._phase_start[name] = now
        if self._current is not None:
            self._current.marks.append((now, name))

    @contextmanager
    def step(self) -> Iterator[None]:
        """One training step: its peak counts; at its end (before
        ``zero_grad``) what the model and optimizer hold is categorised."""
        current = _Step(len(self._events_seq))
        self._steps.append(current)
        self._current = current
        try:
            yield
        finally:
            self.phase("after step")
            self._classify_holders()
            current.last_event = len(self._events_seq)
            self._current = None
            self._phase = "between steps"

    def _classify_holders(self) -> None:
        def fix(t: torch.Tensor | None, category: str) -> None:
            if t is None:
                return
            for storage in _storages(t):
                seq = self._seq(storage)
                if seq is not None:
                    self._fixed.setdefault(seq, category)

        if self.model is None:
            return
        for p in self.model.parameters():
            fix(p, "sharded_params")
        for b in self.model.buffers():
            fix(b, "buffers")
        for p in self.model.parameters():
            fix(p.grad, "gradients")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        fix(v, "optimizer_state")

    # ---- the result ----------------------------------------------------------
    def _category(self, seq: int) -> str:
        fixed = self._fixed.get(seq) or self._tags.get(seq)
        if fixed is not None:
            return fixed
        phase, region, made_at = self._made[seq]
        if region is not None and region in _REGION_CATEGORY:
            return _REGION_CATEGORY[region]
        if phase == "batch":
            return "activations"
        if phase == "forward":
            freed = self._freed.get(seq)
            for start, end in self._forward_ends:
                if start <= made_at <= end:
                    return "activations" if freed is None or freed > end else "temporaries"
            return "activations"
        return "temporaries"

    def result(self) -> StepMemory:
        """Peak live bytes over the tracked steps, by category, and the last step's timeline and collectives."""
        if not self._steps:
            raise RuntimeError("MemoryTracker.result: no step was tracked; wrap each step in `with tracker.step():`")
        cats = {seq: self._category(seq) for seq in self._made}
        totals = dict.fromkeys(CATEGORIES, 0)
        live = 0
        peak, peak_cats, peak_event = -1, dict(totals), 0
        windows = [(s.first_event, s.last_event) for s in self._steps]
        w = 0
        last = self._steps[-1]
        marks = iter(last.marks)
        mark = next(marks, None)
        timeline: list[TimelinePoint] = []
        n = len(self._events_seq)
        end_at = last.last_event
        end_cats = dict(totals)
        for i in range(n + 1):
            if i == end_at:
                end_cats = dict(totals)
            while mark is not None and mark[0] == i:
                timeline.append(TimelinePoint(mark[1], live))
                mark = next(marks, None)
            while w < len(windows) and i >= windows[w][1]:
                w += 1
            if i == n:
                break
            seq, delta = self._events_seq[i], self._events_delta[i]
            totals[cats[seq]] += delta
            live += delta
            if w < len(windows) and windows[w][0] <= i < windows[w][1] and live > peak:
                peak, peak_cats, peak_event = live, dict(totals), i
        if peak < 0:  # nothing happened inside the steps: the standing memory is the peak
            peak, peak_cats = live, dict(totals)
        peak_at = "start"
        for s in self._steps:
            for at, label in s.marks:
                if at <= peak_event:
                    peak_at = label
        return StepMemory(peak, peak_cats, peak_at, timeline, dict(last.comm), dict(last.calls), end_cats)
