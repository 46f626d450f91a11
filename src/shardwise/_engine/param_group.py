"""The communication unit: the parameters of one ``fully_shard`` call, gathered
by one all-gather and reduced by one reduce-scatter.

A group is three things kept apart: its settings (``GroupSettings``, what the
front ends set), its plan (``GroupPlan``, computed once from the parameters'
layouts) and its runtime state (what one step changes; ``reset_step`` returns
it to idle).

[Note: prefetch order]
Collectives on one process group complete in issue order, so overlap is decided
by when each is issued. In forward, a group issues its own all-gather, then the
next group's (the order recorded in the first iteration, or the explicit list),
then waits for its own: the next gather runs while this group computes. In
backward, the order is the reverse of this iteration's post-forward order; a
group prefetches the one before it once its own gather is issued. Groups are
resharded after their forward/backward, so besides the root at most the current
and the prefetched group hold unsharded parameters.

[Note: mixed-dtype groups]
Parameters of one group may differ in dtype (frozen or trainable bf16 weights
beside fp32 adapters, non-floating parameters). Without ``param_dtype`` each
is gathered in its own dtype (the packed path: one collective of bytes), its
gradient reduced in its own dtype (one reduce-scatter per dtype, in parameter
order) and installed in its own dtype; ``reduce_dtype`` makes the reduction
one dtype again. The one-dtype flat buffer stays the fast path.

[Note: pending reductions]
A reduce-scatter is issued asynchronously in post-backward and finished (waited,
all-reduced across replicas for HSDP, divided, installed as ``.grad``) later: at
the next group's post-backward (keeping at most ``max_pending`` in flight
besides the new one; one queue under the root) or at the end of backward. HSDP
all-reduces are likewise issued async and finished one step later.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
import torch.nn as nn

import shardwise.observe as observe
from shardwise.comm import WorkHandle, exchanges_together, packs_exchanges
from shardwise.errors import ConfigError, MixedDtypeError
from shardwise.layout import FlatLayout, ShardLayout
from shardwise.mesh import MeshInfo, SubgroupInfo
from shardwise.policies import MixedPrecisionPolicy

from . import collectives as coll
from .plan import GroupPlan
from .prefetch import prefetch_run
from .settings import GroupSettings
from .sharded_param import ShardedParam, ShardedState, alloc_storage, free_storage, same_version
from .sharded_param import step_in_backward_optimizers
from .trace import log_hook, outside_functorch, trace

# The module state type (module_state.ModuleState, which imports this module).
S = TypeVar("S")


class TrainingState(Enum):
    """What the group is doing in the current iteration."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


@dataclass
class PendingReduction:
    """A gradient reduction between its reduce-scatter and its ``.grad``."""

    group: ParamGroup
    params: list[ShardedParam]
    result: coll.ReduceScatterResult
    # The replicate all-reduce (HSDP) once issued.
    all_reduce_work: WorkHandle | None = None


@dataclass
class IterationContext(Generic[S]):
    """State shared by every group under one root, for one iteration at a time
    (``S``: the module-state type, ``module_state.ModuleState``)."""

    root: S | None = None
    states: list[S] = field(default_factory=list)
    # Groups in pre-forward order, recorded during the first forward; then frozen.
    forward_order: list[ParamGroup] | None = None
    recording: list[ParamGroup] = field(default_factory=list)
    forward_index: dict[int, int] = field(default_factory=dict)
    # Groups in post-forward order this iteration (reverse = backward order).
    post_forward_order: list[ParamGroup] = field(default_factory=list)
    pending: deque[PendingReduction] = field(default_factory=deque)
    # Reduce-scatters left in flight while backward goes on (the queue's bound,
    # as set_reduce_scatter_max_input_buffers set it); None: 1, or as many as
    # the latest backward prefetch run is long ([Note: prefetch runs]).
    max_pending: int | None = None
    # That run's length; 0 outside a backward.
    run_pending: int = 0
    # The root's end-of-backward callback is queued (once per backward, and
    # not again in a nested backward such as reentrant checkpointing's). A
    # backward that raised leaves it set: the root's next forward, outside
    # any backward, sees that and recovers (module_state.pre_forward).
    final_callback_queued: bool = False
    post_optim_event: Any = None
    # Communication buffers shared by the groups under this root.
    pool: coll.BufferPool = field(default_factory=coll.BufferPool)

    def freeze_forward_order(self) -> None:
        if self.forward_order is None and self.recording:
            self.forward_order = list(self.recording)
            self.forward_index = {id(g): i for i, g in reversed(list(enumerate(self.forward_order)))}
        self.recording = []

    def forward_prefetch(self, group: ParamGroup) -> list[ParamGroup]:
        """What ``group``'s pre-forward prefetches by default: the next group,
        or a run of small ones ([Note: prefetch runs])."""
        if self.forward_order is None:
            return []
        i = self.forward_index.get(id(group))
        if i is None:
            return []
        return prefetch_run(itertools.islice(self.forward_order, i + 1, None), backward=False)

    def drain(self, keep: int) -> None:
        """Finish pending reductions, oldest first, until at most ``keep`` remain."""
        while len(self.pending) > keep:
            pr = self.pending.popleft()
            if pr.group.advance_reduction(pr):
                continue
            self.pending.append(pr)  # its all-reduce is now in flight

    def abandon_pending(self) -> None:
        """Wait for every reduction in flight and drop it (after an exception)."""
        while self.pending:
            pr = self.pending.popleft()
            for work in (pr.result.work, pr.all_reduce_work):
                if work is not None:
                    work.wait()


def check_trainable_dtypes(trainable: list[tuple[torch.dtype, str]], mp: MixedPrecisionPolicy) -> None:
    """For the wrapper API (PyTorch's FSDP1 flattens a unit into one dtype):
    raise ``MixedDtypeError`` if the ``(dtype, name)`` of one unit's trainable
    parameters name several dtypes and ``mp`` sets no ``param_dtype``.
    ``fully_shard`` groups accept them (see [Note: mixed-dtype groups])."""
    dtypes = {dtype for dtype, _ in trainable}
    if len(dtypes) <= 1 or mp.param_dtype is not None:
        return
    raise MixedDtypeError(
        f"FSDP expects uniform original parameter dtype but got {sorted(map(str, dtypes))} among "
        f"the trainable parameters of one fully_shard group "
        f"({', '.join(f'{fqn}: {dtype}' for dtype, fqn in trainable[:4])}, ...). Give them one "
        "dtype, set MixedPrecisionPolicy(param_dtype=...), freeze the odd ones, or shard the "
        "differing modules separately."
    )


class ParamGroup:
    """Parameters that are gathered together and reduced together."""

    def __init__(
        self,
        params: list[ShardedParam],
        sources: list[torch.Tensor],
        info: MeshInfo,
        device: torch.device,
        settings: GroupSettings,
        reshard_after_forward: bool | int,
        storage_device: torch.device,
        name: str,
        pin_memory: bool = False,
    ) -> None:
        self.params = params
        self.info = info
        self.device = device  # compute device: where unsharded parameters live
        self.storage_device = storage_device  # where shards live (CPU when offloaded)
        self.pin_memory = pin_memory
        self.name = name
        self.module_fqn = ""  # under the root (set at lazy init), for log records
        self.settings = settings
        self.ctx: IterationContext[Any] = IterationContext()
        # A process group of its own for reduce-scatters (None: the shard group).
        self._reduce_scatter_group: dist.ProcessGroup | None = None
        # reshard_after_forward=int: the subgroup and its layouts.
        self.reshard_after_forward = True
        self.subgroup: SubgroupInfo | None = None
        self.post_forward_flat: FlatLayout | None = None
        self.set_reshard_after_forward(reshard_after_forward)
        # ---- sharded storage and plan (see _init_storage): the flat buffer of
        # each dtype with its parameters' indices and layout; the only one's
        # buffer again as ``flat_sharded`` when the group has one dtype.
        self.flat_sharded: torch.Tensor | None = None
        self.flat_by_dtype: list[tuple[torch.Tensor, list[int], FlatLayout]] = []
        self.plan = GroupPlan(params, False)
        self._init_storage(sources)
        # ---- runtime state
        self.sharded_state = ShardedState.SHARDED
        # load_state_dict(assign=True) registered new sharded parameters: adopt
        # them into the flat buffer before the next all-gather.
        self.needs_readopt = False
        # Whether the modules hold the unsharded parameters (they may not while
        # UNSHARDED: settings.register_sharded_when_idle).
        self._registered_unsharded = False
        # Open summon_full_params contexts holding this group's full parameters.
        self.summon_depth = 0
        # What a summon set aside (see summon): the param_dtype gathered
        # parameters a backward still needs.
        self._kept: tuple[Any, ...] | None = None
        # The fast path's unsharded parameters: one buffer (storage freed when
        # sharded) and each parameter's plain tensor over it.
        self._unsharded_flat: torch.Tensor | None = None
        self._unsharded_locals: list[torch.Tensor] = []
        # HSDP with all-reduce off: reduce-scattered sums awaiting their all-reduce.
        # (keyed by the parameters reduced together: one entry per reduction dtype)
        self._partial: dict[tuple[int, ...], torch.Tensor] = {}
        self._post_forward_data: torch.Tensor | None = None
        self._offload_events: list[Any] = []  # gradient copies to the host in flight
        self._in_flight: (
            coll.AllGatherResult | tuple[coll.PackedGatherResult, ...] | tuple[coll.AllGatherResult, ...] | None
        ) = None
        # Where each packed input's gathered view is: (collective, index in it).
        self._packed_order: list[tuple[int, int]] = []
        self._packed_dtypes: list[torch.dtype] = []
        self.training_state = TrainingState.IDLE
        self.post_forward_indices: list[int] = []
        self._prefetched = False  # the engine prefetched it; cleared when used
        self._backward_targets: list[ParamGroup] = []

    # ---- configuration --------------------------------------------------------
    def set_reshard_after_forward(self, value: bool | int) -> None:
        from shardwise.mesh import post_forward_subgroup

        if isinstance(value, bool):
            self.reshard_after_forward, self.subgroup, self.post_forward_flat = value, None, None
        else:
            self.reshard_after_forward = True
            self.subgroup = post_forward_subgroup(self.info, value)
            rank = self.subgroup.rank
            self.post_forward_flat = FlatLayout.of(
                [ShardLayout.make(p.full_shape, p.shard_dim, value, rank) for p in self.params]
            )

    def set_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Give reduce-scatters a process group of their own over the shard ranks
        (collective: every rank of the mesh must call it alike)."""
        if not enable:
            self._reduce_scatter_group = None
            return
        if self._reduce_scatter_group is None:
            ranks = dist.get_process_group_ranks(self.info.shard_group)
            self._reduce_scatter_group = dist.new_group(ranks, use_local_synchronization=True)

    def gather_dtype(self, p: ShardedParam, full_precision: bool = False) -> torch.dtype:
        """The dtype ``p`` is all-gathered and computes in."""
        if full_precision or not p.orig_dtype.is_floating_point:
            return p.orig_dtype
        return self.settings.mp.param_dtype or p.orig_dtype

    # ---- sharded storage ------------------------------------------------------
    def _init_storage(self, sources: list[torch.Tensor]) -> None:
        """Lay the shards out in one flat buffer per dtype (one in all when
        dtypes agree: the all-gather input needs no copy-in), or, for tensor
        subclasses (all-gather extensions), one buffer per parameter of the
        source's own type; then plan the group's collectives."""
        device = self.storage_device
        if any(src.device.type == "meta" for src in sources):
            device = torch.device("meta")
        pin = self.pin_memory and device.type == "cpu"
        self.flat_sharded = None
        self.flat_by_dtype = []
        views: list[torch.Tensor] = []
        if all(type(src) in _PLAIN_TYPES for src in sources):
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, src in enumerate(sources):
                by_dtype.setdefault(src.dtype, []).append(i)
            views = [torch.empty(0)] * len(sources)
            for dtype, indices in by_dtype.items():
                flat_layout = FlatLayout.of([self.params[i].layout for i in indices])
                buf = torch.empty(flat_layout.total, dtype=dtype, device=device, pin_memory=pin)
                offs = flat_layout.offsets
                for i, a, b in zip(indices, offs, offs[1:]):
                    views[i] = buf[a:b].view(self.params[i].layout.padded_shape)
                self.flat_by_dtype.append((buf, indices, flat_layout))
            if len(by_dtype) == 1:
                self.flat_sharded = self.flat_by_dtype[0][0]
        else:
            # new_zeros, as PyTorch pads: the op subclasses preserve (torchao's float8 weights).
            views = [s.new_zeros(p.layout.padded_shape, device=device) for p, s in zip(self.params, sources)]
        for p, view, src in zip(self.params, views, sources):
            p.orig_dtype = src.dtype
            p.adopt_storage(view, src)
        self.plan = GroupPlan(self.params, self.flat_sharded is not None)
        self._unsharded_flat = None  # planned anew at the next unshard

    def reset_sharded_params(self) -> None:
        """Re-adopt parameters that ``to_empty`` / ``_apply`` / assign-loading
        replaced, so the flat buffer is again what the module holds; not the
        fakes ``torch.export`` swaps in while tracing."""
        if torch.compiler.is_compiling():
            return
        self.needs_readopt = False
        if all(p.local_is_adopted() for p in self.params):
            # all-gather extension hooks attached to the local shards since
            # fully_shard: plan the group's gathers through them
            if self.sharded_state == ShardedState.SHARDED and any([p.check_extensions() for p in self.params]):
                self.plan = GroupPlan(self.params, self.flat_sharded is not None)
                self._unsharded_flat = None
            return
        if self.sharded_state != ShardedState.SHARDED:
            self.reshard()
        sources = [p.current_source() for p in self.params]
        devices = {s.device for s in sources}
        if len(devices) != 1:
            raise AssertionError(f"rank {dist.get_rank()}: {self.name} shards span devices {devices}")
        dev = devices.pop()
        if dev.type != "meta":
            self.storage_device = dev
        with torch.inference_mode(False):  # the shards outlive a forward under inference_mode
            self._init_storage(sources)

    # ---- unshard / reshard ----------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state == ShardedState.UNSHARDED

    def run_bytes(self) -> int | None:
        """The bytes of the all-gather this group would issue now, when that may
        travel with others' in a prefetch run ([Note: prefetch runs]): not
        issued yet, the fast path's one gather with the default collective
        over gloo, from its shards (not post-forward shards)."""
        if (
            not self.settings.prefetch_runs or not self.plan.fast or self.flat_sharded is None
            or self.sharded_state != ShardedState.SHARDED or self._in_flight is not None
            or not coll.is_default(self.settings.all_gather_comm)
            or not packs_exchanges(self.info.shard_group, self.device)
        ):
            return None
        return self.plan.flat.total * self.info.shard_size * self.gather_dtype(self.params[0]).itemsize

    def may_follow(self, first: ParamGroup, backward: bool) -> bool:
        """Whether this group may join a prefetch run that ``first`` starts: not
        run yet this pass, over the same shard group, gathered in backward,
        and without an explicit prefetch list of its own (prefetched as set)."""
        settings = self.settings
        return (
            self.training_state == TrainingState.IDLE
            and self.info.shard_group is first.info.shard_group
            and (settings.unshard_in_backward or not backward)
            and (settings.backward_prefetch if backward else settings.forward_prefetch) is None
        )

    @property
    def gathering(self) -> bool:
        """Sharded, with an all-gather issued and not yet waited for."""
        return self._in_flight is not None and self.sharded_state == ShardedState.SHARDED

    @outside_functorch
    def unshard(self, async_op: bool = False, full_precision: bool = False) -> None:
        """Issue the all-gather (idempotent: nothing if unsharded or in flight).
        ``full_precision`` gathers every parameter in its own dtype (summon)."""
        if self._in_flight is None and not self.is_unsharded:
            if self.needs_readopt:
                self.reset_sharded_params()
            self._wait_post_optim_event()
            comm = self.settings.all_gather_comm
            with trace(f"shardwise::all_gather ({self.name})"):
                if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
                    data, flat = self._post_forward_data, self.post_forward_flat
                    if self.subgroup is None or data is None or flat is None:
                        raise AssertionError(f"rank {dist.get_rank()}: {self.name} lost its post-forward shards")
                    self._in_flight = coll.start_all_gather(
                        comm, data, flat, self.subgroup.group, data.dtype, self.device, self.name, True, self.ctx.pool
                    )
                elif self.plan.fast and self.flat_sharded is not None:
                    dtype = self.gather_dtype(self.params[0], full_precision)
                    self._in_flight = coll.start_all_gather(
                        comm, self.flat_sharded, self.plan.flat, self.info.shard_group, dtype, self.device,
                        self.name, False, self.ctx.pool,
                    )
                else:
                    dtypes = [self.gather_dtype(p, full_precision) for p in self.params]
                    if (
                        self.settings.all_gather_per_dtype and self.flat_by_dtype
                        and all(d == p.orig_dtype for d, p in zip(dtypes, self.params))
                    ):
                        # One all-gather per dtype, straight from its flat buffer.
                        self._in_flight = tuple(
                            coll.start_all_gather(
                                comm, buf, flat, self.info.shard_group, buf.dtype, self.device, self.name,
                                False, self.ctx.pool,
                            )
                            for buf, _, flat in self.flat_by_dtype
                        )
                    else:
                        self._in_flight = self._start_packed_all_gather(dtypes)
        if not async_op:
            self.wait_for_unshard()

    def _start_packed_all_gather(self, dtypes: list[torch.dtype]) -> tuple[coll.PackedGatherResult, ...]:
        """Several gather dtypes (e.g. frozen bf16 weights beside fp32 adapters)
        or all-gather extensions: one collective over what each parameter sends
        (packed as bytes), or with ``settings.all_gather_per_dtype`` one per
        dtype sent (when casts or extensions rule out gathering each dtype's
        flat buffer as it is)."""
        inputs: list[torch.Tensor] = []
        self._packed_dtypes = dtypes
        for p, dtype in zip(self.params, dtypes):
            if p.has_extensions:
                inputs.extend(p.extension_inputs(p.owners[0][0], self.settings.mp, self.device))
            else:
                inputs.append(p.sharded_data.reshape(-1).to(device=self.device, dtype=dtype, non_blocking=True))
        buckets: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(inputs):
            buckets.setdefault(t.dtype if self.settings.all_gather_per_dtype else torch.uint8, []).append(i)
        order: list[tuple[int, int]] = [(0, 0)] * len(inputs)
        results = []
        for b, indices in enumerate(buckets.values()):
            for j, i in enumerate(indices):
                order[i] = (b, j)
            results.append(coll.start_packed_all_gather(
                self.settings.all_gather_comm, [inputs[i] for i in indices], self.info.shard_size,
                self.info.shard_group, self.device, self.name,
            ))
        self._packed_order = order
        return tuple(results)

    def _finish_packed_all_gather(self, results: tuple[coll.PackedGatherResult, ...]) -> None:
        gathered = [coll.finish_packed_all_gather(r, self.name) for r in results]
        views = iter([gathered[b][j] for b, j in self._packed_order])
        num = self.info.shard_size
        for p, dtype in zip(self.params, self._packed_dtypes):
            if p.has_extensions:
                for buf in p.extension_buffers(self.device):
                    # The unsharded parameter may alias these buffers (e.g. a
                    # post-hook returning them): refilling them must not bump
                    # its version, or autograd's saved copy looks modified.
                    with same_version(buf):
                        buf.view(num, -1).copy_(next(views))
                p.finish_extension(dtype)
            else:
                full = p.ensure_unsharded(dtype, self.device)
                p.layout.gather_into(full, next(views).view(num, *p.layout.padded_shape))

    def _unsharded_fast(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The fast path's unsharded parameters, in one buffer: allocated in one
        go (created the first time, and anew if the dtype or device changed),
        returned as the plain tensors to gather into. Over a one-rank shard
        group that buffer is the shards' own ([Note: one-rank groups alias
        their shards])."""
        buf = self._unsharded_flat
        alias = self._aliases_shards(dtype)
        if buf is not None and buf.dtype == dtype and buf.device == self.device and alias == (buf is self.flat_sharded):
            if not alias:
                alloc_storage(buf)
            for p in self.params:
                up = p.unsharded_param
                if up is not None and up.requires_grad != p.requires_grad:
                    up.requires_grad_(p.requires_grad)
            return self._unsharded_locals
        if alias and self.flat_sharded is not None:
            buf = self.flat_sharded
            # Over the very storage each sharded parameter's local tensor has
            # (its span of the flat buffer), so whoever counts storages (the
            # memory tracker) sees one tensor's memory once.
            places = [p.shard_place() for p in self.params]
        else:
            rel, total = self.plan.unsharded_offsets(dtype.itemsize)
            with torch.inference_mode(False):  # reused by later training steps
                buf = torch.empty(total, dtype=dtype, device=self.device)
            storage = buf.untyped_storage()
            places = [(storage, off) for off in rel]
        self._unsharded_locals = [
            p.ensure_unsharded(dtype, self.device, storage, off) for p, (storage, off) in zip(self.params, places)
        ]
        self._unsharded_flat = buf
        return self._unsharded_locals

    # [Note: one-rank groups alias their shards]
    # Over a one-rank shard group (world size 1, NO_SHARD, HSDP with shard
    # size 1) a shard is its whole parameter, and the group's flat shard
    # buffer already holds every parameter whole, back to back. When the
    # gather would be a plain copy of it (our own collectives, the same dtype
    # and device: no mixed-precision cast, no offload to another device),
    # the unsharded parameters are tensors over that buffer itself: nothing
    # is copied in, copied out, allocated or freed, and the step holds one
    # copy of the parameters, not two. Unsharded and sharded parameters stay
    # separate tensors (their own autograd version counters), as they are
    # when copied. What follows is what FSDP1 documents for NO_SHARD and
    # world size 1 (where it does not shard either): writes to the unsharded
    # parameters persist, with ``summon_full_params(writeback=False)`` too,
    # and an in-place update of the shards between a forward and its
    # backward is seen by that backward. Only where every parameter starts 16
    # bytes aligned in the buffer (what vectorised kernels and cuBLAS want);
    # otherwise the parameters are copied into an aligned buffer as before.
    def _aliases_shards(self, dtype: torch.dtype) -> bool:
        src = self.flat_sharded
        return (
            src is not None and src.dtype == dtype and src.device == self.device
            and self.plan.whole_and_aligned(dtype.itemsize) and src.storage_offset() == 0
            and not coll.communicates(self.settings.all_gather_comm, self.info.shard_group)
        )

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish the in-flight all-gather: copy out, register unsharded params."""
        result = self._in_flight
        if result is None:
            return
        self._in_flight = None
        with trace(f"shardwise::all_gather_copy_out ({self.name})"):
            if isinstance(result, coll.AllGatherResult):
                dtype = result.output.dtype
                if self.plan.fast:
                    fulls = self._unsharded_fast(dtype)
                else:
                    fulls = [p.ensure_unsharded(dtype, self.device) for p in self.params]
                if not (self.plan.fast and self._unsharded_flat is result.output is self.flat_sharded):
                    coll.finish_all_gather(result, fulls, self.name, self.ctx.pool)
                # else: the unsharded parameters are the shards themselves, and nothing was sent
            elif all(isinstance(r, coll.AllGatherResult) for r in result):
                gathers = cast(tuple[coll.AllGatherResult, ...], result)
                for r, (_, indices, _) in zip(gathers, self.flat_by_dtype):
                    fulls = [self.params[i].ensure_unsharded(r.output.dtype, self.device) for i in indices]
                    coll.finish_all_gather(r, fulls, self.name, self.ctx.pool)
            else:
                self._finish_packed_all_gather(cast(tuple[coll.PackedGatherResult, ...], result))
        self._post_forward_data = None
        self.sharded_state = ShardedState.UNSHARDED
        self._register_unsharded()

    def ensure_unsharded(self) -> None:
        """Gathered and shown on the modules now, whatever happened since the
        group's forward began (see [Note: modules sharded together])."""
        self.unshard(async_op=True)
        self.wait_for_unshard()
        self._register_unsharded()

    def _register_unsharded(self) -> None:
        """Show the gathered parameters on the modules (unsharded groups only)."""
        if self.is_unsharded and not self._registered_unsharded:
            for p in self.params:
                p.register_unsharded()
            self._registered_unsharded = True

    def _free_unsharded(self) -> None:
        if self.plan.fast and self._unsharded_flat is not None:
            if self._unsharded_flat is not self.flat_sharded:  # else the shards themselves
                free_storage(self._unsharded_flat)
        else:
            for p in self.params:
                p.free_unsharded()
        for p in self.params:
            p.register_sharded()
        self._registered_unsharded = False

    @outside_functorch
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (idempotent)."""
        if self._in_flight is not None:
            self.wait_for_unshard()
        if self.sharded_state == ShardedState.SHARDED:
            return
        self._free_unsharded()
        self._post_forward_data = None
        self.sharded_state = ShardedState.SHARDED
        self._prefetched = False

    def summon(self) -> None:
        """Unshard in the original (full-precision) dtype, outside forward/backward."""
        if self.training_state != TrainingState.IDLE:
            raise ConfigError(
                f"cannot summon full parameters of {self.name} during its forward or backward "
                f"(state {self.training_state.name}); call it outside the training step."
            )
        full = [p.unsharded_param for p in self.params]
        self.summon_depth += 1
        if self.is_unsharded and all(u is not None and u.dtype == p.orig_dtype for u, p in zip(full, self.params)):
            self._register_unsharded()
            return
        low = [u is not None and u.dtype != p.orig_dtype for u, p in zip(full, self.params)]
        if self.summon_depth == 1 and any(low) and not any(p.has_extensions for p in self.params):
            # The param_dtype parameters autograd saved in a forward whose
            # backward is still to come (gathered now: the root, ZeRO-2 units;
            # or freed, to be gathered again into the same memory): set them
            # aside for the summon's full-precision ones, and restore them after.
            if self.sharded_state == ShardedState.SHARDED_POST_FORWARD or self._in_flight is not None:
                self.reshard()
            self._kept = (
                self._unsharded_flat, self._unsharded_locals, self._registered_unsharded, self.is_unsharded,
                [(p.unsharded_param, p._in_group_buffer) for p in self.params],
            )
            self._unsharded_flat, self._unsharded_locals = None, []
            for p in self.params:
                p.unsharded_param, p._in_group_buffer = None, False
            self.sharded_state = ShardedState.SHARDED
            self._registered_unsharded = False
        else:
            self.reshard()
        self.unshard(full_precision=True)

    def end_summon(self) -> None:
        """Leave a summon_full_params context; reshard when the outermost ends
        (and give back parameters a backward still needs)."""
        self.summon_depth = max(0, self.summon_depth - 1)
        if self.summon_depth == 0:
            self.reshard()
            kept, self._kept = self._kept, None
            if kept is not None:
                self._unsharded_flat, self._unsharded_locals, registered, gathered, params = kept
                for p, (up, in_buffer) in zip(self.params, params):
                    p.unsharded_param, p._in_group_buffer = up, in_buffer
                if gathered:
                    self.sharded_state = ShardedState.UNSHARDED
                    if registered:
                        self._register_unsharded()

    def reshard_for_state_dict(self) -> None:
        """State dicts see the sharded parameters, except inside summon_full_params
        (where PyTorch's ``state_dict()`` gives the full ones)."""
        if self.summon_depth == 0:
            self.reshard()

    def write_back(self) -> None:
        """Copy the (possibly modified) unsharded parameters into this rank's shards."""
        if not self.is_unsharded:
            raise AssertionError(f"rank {dist.get_rank()}: {self.name} is not unsharded")
        with torch.no_grad():
            for p in self.params:
                local = p.sharded_data.narrow(p.shard_dim, 0, p.layout.local_rows)
                local.copy_(p.layout.local_chunk(p.unsharded_local()))

    @outside_functorch
    @torch.no_grad()
    def _reshard_post_forward(self) -> None:
        """Keep only this rank's chunk over the post-forward subgroup."""
        flat = self.post_forward_flat
        if flat is None or not self.is_unsharded or not self.plan.fast:
            # Several dtypes or extensions: a full reshard (re-gathered over the
            # whole shard group in backward), as PyTorch has no post-forward path for them.
            self.reshard()
            return
        with trace(f"shardwise::reshard_post_forward ({self.name})"):
            data = torch.empty(flat.total, dtype=self.params[0].unsharded_local().dtype, device=self.device)
            offs = flat.offsets
            for p, layout, a, b in zip(self.params, flat.layouts, offs, offs[1:]):
                view = data[a:b].view(layout.padded_shape)
                rows = layout.local_rows
                if rows:
                    view.narrow(layout.dim, 0, rows).copy_(layout.local_chunk(p.unsharded_local()))
                view.narrow(layout.dim, rows, layout.chunk - rows).zero_()
        self._free_unsharded()
        self._post_forward_data = data
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _wait_post_optim_event(self) -> None:
        event = self.ctx.post_optim_event
        if event is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream().wait_event(event)
            self.ctx.post_optim_event = None

    def prefetch(self) -> None:
        """Engine-initiated async unshard; undone at root post-forward if unused."""
        if self._in_flight is None and not self.is_unsharded:
            self._prefetched = True
            with trace(f"shardwise::prefetch ({self.name})"):
                self.unshard(async_op=True)

    def drop_unused_prefetch(self) -> None:
        """At the root's post-forward: reshard if prefetched for a forward that
        did not come."""
        if self._prefetched and self.training_state == TrainingState.IDLE:
            self.reshard()

    # ---- forward --------------------------------------------------------------
    def pre_forward(self) -> None:
        if self.training_state != TrainingState.PRE_BACKWARD:  # not recomputed in backward
            log_hook("FSDP::pre_forward", self.module_fqn)
        self.training_state = TrainingState.FORWARD
        self._prefetched = False
        if self.ctx.forward_order is None:
            self.ctx.recording.append(self)
        targets = self.settings.forward_prefetch
        if targets is None:
            targets = self.ctx.forward_prefetch(self)
        with coll.outside_checkpoint_modes():  # [Note: gathers outside selective checkpointing]
            with exchanges_together():
                self.unshard(async_op=True)
                for target in targets:
                    if target.training_state == TrainingState.IDLE:
                        target.prefetch()
            self.wait_for_unshard()
        self._register_unsharded()

    def post_forward(self) -> None:
        log_hook("FSDP::post_forward", self.module_fqn)
        if self.reshard_after_forward and self.summon_depth == 0:  # a forward inside summon keeps them whole
            if self.subgroup is not None:
                self._reshard_post_forward()
            else:
                self.reshard()
        elif self.settings.register_sharded_when_idle and self._registered_unsharded and self.summon_depth == 0:
            # Kept for backward, yet FSDP1's modules show their sharded
            # parameters between forward and backward (an optimizer built now
            # must get those); pre-backward registers the gathered ones again.
            for p in self.params:
                p.register_sharded()
            self._registered_unsharded = False
        if torch.is_grad_enabled():
            self.post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    # ---- backward -------------------------------------------------------------
    def pre_backward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        log_hook("FSDP::pre_backward", self.module_fqn)
        self.training_state = TrainingState.PRE_BACKWARD
        self._prefetched = False
        unshard = self.settings.unshard_in_backward
        if unshard:
            self.unshard(async_op=True)
        targets = self.settings.backward_prefetch
        if targets is None:
            targets = []
            if self.post_forward_indices:
                i = self.post_forward_indices.pop()
                order = self.ctx.post_forward_order
                targets = prefetch_run((order[j] for j in range(i - 1, -1, -1)), backward=True)
                if targets and targets[0]._in_flight is None and not targets[0].is_unsharded:
                    # a new run: the reductions of the groups before it wait to travel with the next
                    self.ctx.run_pending = len(targets)
        self._backward_targets = targets
        if not self.settings.prefetch_in_post_backward:
            self._prefetch_backward()
        if unshard:
            self.wait_for_unshard()
            self._register_unsharded()

    def _prefetch_backward(self) -> None:
        targets, self._backward_targets = self._backward_targets, []
        with exchanges_together():
            for target in targets:
                done = target.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
                if target.settings.unshard_in_backward and not done:
                    target.prefetch()

    def post_backward(self) -> None:
        """Reduce-scatter the gradients computed so far, then reshard."""
        log_hook("FSDP::post_backward", self.module_fqn)
        self.training_state = TrainingState.POST_BACKWARD
        settings = self.settings
        sync = settings.requires_grad_sync
        rd = settings.mp.reduce_dtype
        with trace(f"shardwise::post_backward ({self.name})"):
            params, grads = [], []
            for p in self.params:
                up = p.unsharded_param
                if up is None:
                    continue
                # A gradient is reduced even if its parameter was frozen since
                # it was computed (mid-accumulation), as the unsharded model keeps it.
                grad = p.unsharded_grad(settings.refuse_grad_of_grad)
                # Accumulation happens on the gradient as autograd made it: a
                # TP gradient stays a DTensor (Partial over tp for sequence
                # parallel) and is brought to its parameter's placements once,
                # when reduced, as PyTorch's FSDP does (and in reduce_dtype).
                if not sync:
                    if grad is not None and rd is not None and grad.dtype != rd and settings.accumulate_in_reduce_dtype:
                        acc = p.unsharded_accumulated_grad
                        p.unsharded_accumulated_grad = grad.to(rd) if acc is None else acc.add_(grad)
                        up.grad = None
                    continue
                acc = p.unsharded_accumulated_grad
                if acc is not None:
                    grad = acc if grad is None else acc.add_(grad)
                    p.unsharded_accumulated_grad = None
                if grad is not None:
                    grad = p.grad_local(grad)
                if grad is None and settings.reduce_scatter_unused_params and p.requires_grad:
                    grad = torch.zeros(p.full_shape, dtype=up.dtype, device=self.device)
                if grad is None:
                    continue
                up.grad = None
                params.append(p)
                grads.append(grad)
            if observe.observing():
                observe.tag("gradients", grads)
            # Free this group's parameters and issue the next gather (in
            # BACKWARD_POST mode) before reducing: the gradients are separate tensors.
            if settings.reshard_after_backward:
                self.reshard()
            self._prefetch_backward()
            # One reduce-scatter per reduction dtype: a group may hold trainable
            # parameters of several dtypes (fp32 adapters beside bf16 weights),
            # each reduced in its own (or in reduce_dtype, when set).
            buckets: dict[torch.dtype, tuple[list[ShardedParam], list[torch.Tensor]]] = {}
            for p, grad in zip(params, grads):
                bucket = buckets.setdefault(rd or grad.dtype, ([], []))
                bucket[0].append(p)
                bucket[1].append(grad)
            for dtype, (bucket_params, bucket_grads) in buckets.items():
                if self._grads_are_shards(bucket_grads, dtype):
                    # [Note: one-rank groups alias their shards]: nothing to reduce
                    for p, grad in zip(bucket_params, bucket_grads):
                        p.shard_grad(grad)
                    step_in_backward_optimizers(bucket_params, settings.step_in_backward_optimizers)
                    continue
                keep = self.ctx.max_pending
                self.ctx.drain(keep=max(1, self.ctx.run_pending) if keep is None else keep)
                self.ctx.pending.append(self._start_reduction(bucket_params, bucket_grads, dtype))

    def _grads_are_shards(self, grads: list[torch.Tensor], dtype: torch.dtype) -> bool:
        """Whether a one-rank group's reduction of ``grads`` in ``dtype`` would
        be the gradients themselves, copied: our own reduce-scatter over one
        rank, no replicas to all-reduce over, no hook, no division, no cast,
        no offload. Then each gradient is installed as its shard as it is."""
        settings = self.settings
        return (
            self.plan.whole
            and self.info.replicate_group is None and settings.all_reduce_hook is None
            and not coll.communicates(settings.reduce_scatter_comm, self._reduce_scatter_group or self.info.shard_group)
            and self._divide_factors(dtype) == (1.0, 1.0)
            and self.storage_device == self.device
            and not (settings.keep_low_precision_grads and settings.mp.param_dtype is not None)
            and all(g.dtype == dtype and g.is_contiguous() for g in grads)
        )

    def _divide_factors(self, dtype: torch.dtype) -> tuple[float, float]:
        settings = self.settings
        custom = settings.gradient_divide_factor
        factor = float(custom or self.info.dp_size)
        return self.plan.divide_factors(dtype, factor, settings.fsdp1_divide and custom is None)

    def _start_reduction(
        self, params: list[ShardedParam], grads: list[torch.Tensor], dtype: torch.dtype
    ) -> PendingReduction:
        pre, _ = self._divide_factors(dtype)
        flat = self.plan.flat_of(params)
        with trace(f"shardwise::reduce_scatter ({self.name})"):
            result = coll.start_reduce_scatter(
                self.settings.reduce_scatter_comm, grads, flat, self._reduce_scatter_group or self.info.shard_group,
                dtype, self.device, pre, self.name, self.ctx.pool,
            )
        return PendingReduction(self, params, result)

    def advance_reduction(self, pr: PendingReduction) -> bool:
        """Move ``pr`` one stage on; True when its gradients are installed."""
        settings = self.settings
        out = pr.result.output
        if pr.all_reduce_work is not None:
            pr.all_reduce_work.wait()
        else:
            if pr.result.work is not None:
                coll._guard(self.name, "ReduceScatter work", pr.result.work.wait)
            if pr.result.pooled:
                self.ctx.pool.give(*pr.result.pooled)
            if self.info.replicate_group is not None:
                key = tuple(id(p) for p in pr.params)
                partial = self._partial.pop(key, None)
                if partial is not None:
                    out.add_(partial)
                if any(set(k) & set(key) for k in self._partial):
                    raise AssertionError(f"{self.name}: partial reduction over other parameters")
                if not settings.requires_all_reduce:
                    self._partial[key] = out
                    return True
                group = self.info.replicate_group
                hook = settings.replicate_all_reduce
                if hook is not None:
                    work = coll._guard(self.name, "all-reduce hook", lambda: hook(out, group))
                else:
                    work = dist.all_reduce(out, group=group, async_op=True)
                if work is not None:
                    pr.all_reduce_work = work
                    return False
        _, post = self._divide_factors(out.dtype)
        if post != 1.0:
            out.div_(post)
        if settings.all_reduce_hook is not None:
            settings.all_reduce_hook(out)
        # Our own buffers are fresh per call, so gradients may be views of them.
        alias = coll.is_default(settings.reduce_scatter_comm)
        grad_dtype = settings.mp.param_dtype if settings.keep_low_precision_grads else None
        host = self._offload_copy(out, pr.params, grad_dtype)
        if host is not None:
            out, alias = host, True
        for p, shard in zip(pr.params, pr.result.flat.local_views(out)):
            if host is not None and (p.sharded_param.grad is not None or p.has_post_accumulate_grad_hooks):
                self.wait_for_offloaded_grads()  # accumulating or a hook reads the host copy now
            p.shard_grad(shard if alias else shard.clone(), dtype=grad_dtype)
        step_in_backward_optimizers(pr.params, settings.step_in_backward_optimizers)
        return True

    def _offload_copy(
        self, out: torch.Tensor, params: list[ShardedParam], grad_dtype: torch.dtype | None
    ) -> torch.Tensor | None:
        """Offloaded shards on pinned host memory, gradients reduced on an
        accelerator: the whole reduced buffer goes to the host in one
        asynchronous copy into pinned memory (cast first, on the device), its
        end recorded as an event that ``finalize_backward`` waits for before
        the optimizer can read it (as PyTorch's offload does per parameter).
        None where that does not apply (per-parameter copies then)."""
        if not self.pin_memory or out.device.type == "cpu" or self.storage_device.type != "cpu":
            return None
        dtypes = {grad_dtype or p.orig_dtype for p in params}
        if len(dtypes) != 1:
            return None
        host = torch.empty(out.shape, dtype=dtypes.pop(), pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.Event(out.device)
        event.record()
        self._offload_events.append(event)
        return host

    def wait_for_offloaded_grads(self) -> None:
        """Block until every asynchronous gradient copy to the host has landed."""
        for event in self._offload_events:
            event.synchronize()
        self._offload_events.clear()

    def finalize_backward(self) -> None:
        """End of backward: reduce what hooks missed, reshard, reset state."""
        if self.training_state != TrainingState.POST_BACKWARD:
            has_grads = any(
                p.unsharded_param is not None and p.unsharded_param.grad is not None
                for p in self.params
            )
            if self.training_state == TrainingState.PRE_BACKWARD or (
                has_grads and self.settings.requires_grad_sync
            ):
                self.post_backward()
        if self._in_flight is not None:
            self.wait_for_unshard()
            if self._prefetched:
                self.reshard()
        if self.settings.reshard_after_backward and self.sharded_state != ShardedState.SHARDED:
            self.reshard()
        self.reset_step()

    def reset_step(self) -> None:
        """Back to idle between steps: what one iteration's hooks recorded."""
        self.training_state = TrainingState.IDLE
        self.post_forward_indices.clear()
        self._backward_targets = []
        self._prefetched = False

    def abort_step(self) -> None:
        """After an exception mid-step: finish the gather in flight, reshard,
        drop the step's state and the gradients it accumulated unsharded."""
        if self._in_flight is not None:
            self.wait_for_unshard()
        self.reshard()
        self.reset_step()
        for p in self.params:
            p.unsharded_accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        self._partial = {}


_PLAIN_TYPES = (torch.Tensor, nn.Parameter, FakeTensor)
"""Tensors laid out in the flat buffers; other subclasses (all-gather
extensions such as torchao's float8 weights) get a buffer each. Fake tensors
(the planner's) stand for plain ones."""


__all__ = [
    "ParamGroup",
    "TrainingState",
    "IterationContext",
    "PendingReduction",
    "check_trainable_dtypes",
    "free_storage",
]
