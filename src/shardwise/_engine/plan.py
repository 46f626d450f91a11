"""A group's plan: everything about its collectives that follows from its
parameters' shapes and placements, computed once when its shards are laid out
(at ``fully_shard`` and whenever ``to_empty`` / ``_apply`` / assign-loading
replaced them), instead of at every collective of every step."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardwise.layout import FlatLayout

from .sharded_param import ShardedParam

# The unsharded parameters of a group live in one buffer, each starting at a
# multiple of this many bytes (what vectorised kernels and cuBLAS prefer).
_ALIGN_BYTES = 64


class GroupPlan:
    """What a group's all-gathers and reduce-scatters are made of."""

    def __init__(self, params: Sequence[ShardedParam], flat_sharded: bool) -> None:
        # Each rank's shards back to back (the all-gather input) and each
        # rank's row of the gathered and reduce-scatter buffers.
        self.flat = FlatLayout.of([p.layout for p in params])
        # One all-gather of the flat shards in one dtype serves the group (no
        # all-gather extensions, one dtype): the fast path. Its unsharded
        # parameters then share one buffer, allocated and freed at once.
        self.fast = flat_sharded and not any(p.has_extensions for p in params)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._subsets: dict[tuple[int, ...], FlatLayout] = {}
        self._full_numels = [p.full_shape.numel() for p in params]
        self._full_offsets: dict[int, tuple[list[int], int]] = {}
        self._factors: dict[tuple[torch.dtype, float, bool], tuple[float, float]] = {}
        self._aligned: dict[int, bool] = {}

    def flat_of(self, params: Sequence[ShardedParam]) -> FlatLayout:
        """The flat layout of some of the group's parameters (those with a
        gradient this step, or one dtype's of a mixed group), in group order:
        built the first time a subset is seen, then reused every step."""
        if len(params) == len(self.flat.layouts):
            return self.flat
        key = tuple(self._index[id(p)] for p in params)
        flat = self._subsets.get(key)
        if flat is None:
            flat = self._subsets[key] = FlatLayout.of([p.layout for p in params])
        return flat

    def unsharded_offsets(self, itemsize: int) -> tuple[list[int], int]:
        """Where each unsharded parameter starts in the group's unsharded
        buffer of elements of ``itemsize`` bytes, and the buffer's length."""
        cached = self._full_offsets.get(itemsize)
        if cached is None:
            align = max(1, _ALIGN_BYTES // itemsize)
            offsets, acc = [], 0
            for n in self._full_numels:
                offsets.append(acc)
                acc += -(-n // align) * align
            cached = self._full_offsets[itemsize] = (offsets, acc)
        return cached

    @property
    def whole(self) -> bool:
        """Whether each shard is its whole parameter (one shard each, on dim 0)."""
        return self.flat.num_shards == 1 and self.flat.dim0

    def whole_and_aligned(self, itemsize: int) -> bool:
        """Whether the shards are ``whole`` and each starts 16 bytes aligned in
        the flat buffer, for elements of ``itemsize`` bytes: the unsharded
        parameters may then be the shards ([Note: one-rank groups alias
        their shards])."""
        ok = self._aligned.get(itemsize)
        if ok is None:
            ok = self._aligned[itemsize] = self.whole and all(
                off * itemsize % 16 == 0 for off in self.flat.offsets[:-1]
            )
        return ok

    def divide_factors(self, dtype: torch.dtype, factor: float, fsdp1: bool = False) -> tuple[float, float]:
        """``(before, after)`` the sum: dividing a reduction of ``dtype`` by
        ``factor``. ``fully_shard`` (as PyTorch's) splits the division around
        the sum only in low precision, against overflow and underflow, and
        divides fp32 after it. ``fsdp1``: FSDP1's split in every dtype
        (``fsdp1_predivide`` before, the rest after). Powers of two divide
        exactly, so the split decides bits only near overflow and underflow
        (at six ranks fully_shard's fp16 split is 2 and 3, FSDP1's 4 and 1.5)."""
        key = (dtype, factor, fsdp1)
        cached = self._factors.get(key)
        if cached is None:
            if fsdp1:
                pre = fsdp1_predivide(factor)
                cached = (pre, factor / pre)
            elif dtype.itemsize >= 4 or factor <= 1:
                cached = (1.0, factor)
            else:
                pre = 2.0 ** round(math.log2(math.sqrt(factor)))
                cached = (pre, factor / pre)
            self._factors[key] = cached
        return cached


def fsdp1_predivide(factor: float) -> float:
    """FSDP1's division before the sum, for a division by ``factor``: the
    power of two reached by doubling from 1 while it divides ``factor`` and
    stays below ``factor`` over it (2 at two to four ranks, 4 at six)."""
    pre = 1.0
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre


__all__ = ["GroupPlan", "fsdp1_predivide"]
