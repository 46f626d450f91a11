"""How tensors are laid out across ranks, in one place: how ``torch.chunk``
cuts a dimension of ``size`` into ``parts`` pieces (every piece
``ceil(size / parts)`` long except the last non-empty one; trailing pieces may
be empty), and a DTensor laid out like another over a given local tensor.
Parameters, gradients, optimizer state, state dicts, checkpoints and the memory
planner all use it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

__all__ = ["FlatLayout", "ShardLayout", "chunk_rows", "chunk_span", "dtensor_like"]


def dtensor_like(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride over
    ``local`` (this rank's piece, e.g. moved, cast or freshly read); no
    communication."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def chunk_rows(size: int, parts: int) -> int:
    """Rows of every full piece: ``ceil(size / parts)`` (0 for an empty dim)."""
    return -(-size // parts) if size else 0


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``torch.chunk`` over a dim of
    ``size`` cut in ``parts``: ``length`` is 0 past the last piece."""
    chunk = chunk_rows(size, parts)
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


class ShardLayout(NamedTuple):
    """How one tensor is cut into ``num_shards`` chunks along ``dim``, exactly as
    ``torch.chunk`` cuts it: every chunk holds ``chunk`` rows except the last
    non-empty one; ranks past the last chunk hold nothing. Each rank's chunk is
    stored padded to ``chunk`` rows so that collectives see equal sizes."""

    num_shards: int
    rank: int
    dim: int
    dim_size: int
    chunk: int
    padded_shape: torch.Size

    @staticmethod
    def make(shape: torch.Size, dim: int, num_shards: int, rank: int) -> ShardLayout:
        dim_size = shape[dim]
        chunk = chunk_rows(dim_size, num_shards)
        padded = list(shape)
        padded[dim] = chunk
        return ShardLayout(num_shards, rank, dim, dim_size, chunk, torch.Size(padded))

    def rows(self, rank: int) -> int:
        """Real (unpadded) rows of ``rank``'s chunk."""
        return chunk_span(self.dim_size, self.num_shards, rank)[1]

    @property
    def even(self) -> bool:
        """Every rank's chunk is whole (no padding): its part of each rank's
        row of a flat buffer is the tensor's [num_shards, numel / num_shards] view."""
        return self.chunk > 0 and self.chunk * self.num_shards == self.dim_size

    @property
    def local_rows(self) -> int:
        return self.rows(self.rank)

    @property
    def padded_numel(self) -> int:
        return self.padded_shape.numel()

    def gather_into(self, full: torch.Tensor, gathered: torch.Tensor) -> None:
        """Copy every rank's padded chunk (``gathered``: [num_shards, *padded_shape])
        into the full tensor, dropping padding. At most two copies."""
        if self.chunk == 0:
            return
        whole = self.dim_size // self.chunk  # ranks whose chunk is full
        if whole:
            dst = self._split_rows(full.narrow(self.dim, 0, whole * self.chunk), whole)
            dst.movedim(self.dim, 0).copy_(gathered[:whole])
        rem = self.dim_size - whole * self.chunk
        if rem:
            full.narrow(self.dim, whole * self.chunk, rem).copy_(
                gathered[whole].narrow(self.dim, 0, rem)
            )

    def scatter_from(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Inverse of :meth:`gather_into`: lay ``full`` out as padded chunks in
        ``out`` ([num_shards, *padded_shape]), zeroing the padding."""
        if self.chunk == 0:
            return
        whole = self.dim_size // self.chunk
        if whole:
            src = self._split_rows(full.narrow(self.dim, 0, whole * self.chunk), whole)
            out[:whole].copy_(src.movedim(self.dim, 0))
        rem = self.dim_size - whole * self.chunk
        if whole < self.num_shards:
            tail = out[whole]
            if rem:
                tail.narrow(self.dim, 0, rem).copy_(full.narrow(self.dim, whole * self.chunk, rem))
            tail.narrow(self.dim, rem, self.chunk - rem).zero_()
            out[whole + 1 :].zero_()

    def _split_rows(self, t: torch.Tensor, whole: int) -> torch.Tensor:
        """View ``t``'s ``dim`` (``whole * chunk`` long) as ``(whole, chunk)``."""
        shape = list(t.shape)
        return t.view(*shape[: self.dim], whole, self.chunk, *shape[self.dim + 1 :])

    def local_chunk(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """``rank``'s unpadded chunk of ``full`` (a view)."""
        start, rows = chunk_span(self.dim_size, self.num_shards, self.rank if rank is None else rank)
        return full.narrow(self.dim, start, rows)


class FlatLayout(NamedTuple):
    """Several padded shards back to back in one flat buffer (a group's
    sharded storage, and each rank's row of its all-gather / reduce-scatter
    buffers), computed once per group rather than per collective."""

    layouts: tuple[ShardLayout, ...]
    offsets: tuple[int, ...]  # where each starts; the last entry is the total
    sizes: tuple[int, ...]  # padded elements of each
    num_shards: int
    # Every parameter sharded on dim 0: copies may go through the fused kernels.
    dim0: bool
    # ... and each holds at least one row per rank (``torch._chunk_cat`` applies).
    chunk_cat: bool
    # ... and each is ``ShardLayout.even`` (nothing padded).
    even: bool
    # This rank's unpadded chunk of each, as ``local_views`` cuts a row: with
    # ``dim0``, each chunk's numel then its padding's (one split for them all).
    local_split: tuple[int, ...]
    local_shapes: tuple[torch.Size, ...]

    @staticmethod
    def of(layouts: Sequence[ShardLayout]) -> FlatLayout:
        offsets, acc = [], 0
        for layout in layouts:
            offsets.append(acc)
            acc += layout.padded_numel
        offsets.append(acc)
        dim0 = all(layout.dim == 0 for layout in layouts)
        local_shapes = []
        for layout in layouts:
            dims = list(layout.padded_shape)
            dims[layout.dim] = layout.local_rows
            local_shapes.append(torch.Size(dims))
        split: list[int] = []
        if dim0:
            for layout, local in zip(layouts, local_shapes):
                split += [local.numel(), layout.padded_numel - local.numel()]
        return FlatLayout(
            tuple(layouts),
            tuple(offsets),
            tuple(layout.padded_numel for layout in layouts),
            layouts[0].num_shards if layouts else 1,
            dim0,
            dim0 and all(layout.chunk > 0 for layout in layouts),
            dim0 and all(layout.even for layout in layouts),
            tuple(split),
            tuple(local_shapes),
        )

    def local_views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """This rank's unpadded chunk of each tensor, as views of ``row``
        (its padded shards back to back, e.g. a reduce-scatter's output).
        On dim 0 a chunk is the start of its padded shard: one split cuts
        them all, and each is viewed in its shape."""
        if self.dim0:
            pieces = torch.split_with_sizes(row, self.local_split)
            return [piece.view(shape) for piece, shape in zip(pieces[::2], self.local_shapes)]
        return [
            row[a:b].view(layout.padded_shape).narrow(layout.dim, 0, layout.local_rows)
            for layout, a, b in zip(self.layouts, self.offsets, self.offsets[1:])
        ]

    @property
    def total(self) -> int:
        return self.offsets[-1]
