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
        self._factors: dict[tuple[torch.dtype, float], tuple[float, float]] = {}
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

    def divide_factors(self, dtype: torch.dtype, factor: float) -> tuple[float, float]:
        """``(before, after)`` the sum: dividing a reduction of ``dtype`` by
        ``factor``. Low precision splits the division around the sum against
        overflow and underflow (as PyTorch does); otherwise all of it after."""
        key = (dtype, factor)
        cached = self._factors.get(key)
        if cached is None:
            if dtype.itemsize >= 4 or factor <= 1:
                cached = (1.0, factor)
            else:
                pre = 2.0 ** round(math.log2(math.sqrt(factor)))
                cached = (pre, factor / pre)
            self._factors[key] = cached
        return cached


__all__ = ["GroupPlan"]
