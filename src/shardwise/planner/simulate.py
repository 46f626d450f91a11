"""A world of fake ranks for running the real training step without
allocating anything: ``torch.distributed``'s ``fake`` process group (every
collective returns at once, nothing is sent) at any world size, with this
process as any one rank, and ``FakeTensorMode`` (tensors carry shapes, dtypes
and devices, no data). Built for the planner; see ``shardwise plan``.

[Note: planning by fake execution]
The planner does not model the engine: it runs it. Under :func:`fake_world`
the model is built on the meta device, sharded with the real ``fully_shard``
(the chunk this rank owns, padding included, comes from the same code as in
a real run), materialised as fake tensors and trained for real steps:
forward, backward, gradient clipping, the optimizer. A
:class:`~shardwise.planner.MemoryTracker` counts every storage the step
makes and frees and every collective it issues, so whatever the engine does
(prefetching, post-forward resharding, mixed precision, activation
checkpointing, hybrid sharding, pooled buffers) is in the figures without a
formula for it. Two steps run and the highest peak of the two counts: the
first makes the optimizer state and the engine's reused buffers, the second
is the steady state.

Ranks differ only in the size of the chunks they own (``torch.chunk``: the
first ranks hold full chunks, a later one a partial chunk, the last ones may
hold none), so ranks whose chunk sizes are the same for every parameter have
the same figures: :func:`rank_classes` finds those classes from the shapes,
and only one rank of each is run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.layout import chunk_span

__all__ = ["fake_world", "rank_classes"]


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[FakeTensorMode]:
    """Run the body as rank ``rank`` of ``world_size`` fake ranks; the
    process group is torn down on exit. Yields the ``FakeTensorMode`` to run
    the step under (not entered: make device meshes first, outside it, as
    they hold real rank tables).

    Build the model on the meta device, make the mesh, then inside the mode
    shard it, ``to_empty`` it and run steps.

    Args:
        world_size: ranks to pretend (``>= 1``; thousands cost nothing more).
        rank: which of them this process is. (Default: ``0``)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fake_world: world_size={world_size!r} must be an int >= 1.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank={rank!r} must be an int in [0, world_size={world_size}).")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: a default process group is already initialised in this process; plan in a process of "
            "its own (e.g. `shardwise plan`), or call dist.destroy_process_group() first."
        )
    # Importing these registers the "fake" backend and the fake-tensor kernels of the c10d collectives.
    import torch.distributed._tools.fake_collectives  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)  # type: ignore[attr-defined]
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        dist.destroy_process_group()


def rank_classes(
    shapes: Sequence[tuple[Sequence[int], int]], world_size: int, shard_size: int | None = None
) -> list[list[int]]:
    """Ranks grouped by the chunk sizes they own: ranks in one class own
    equal chunks of every parameter, so a sharded step costs them the same.

    Classes are listed by their first rank, each as ``[first, ..., last]``
    (consecutive shard indices, and with hybrid sharding every replica's
    ranks at those indices).

    Args:
        shapes: each parameter's ``(shape, shard dim)``.
        world_size: all ranks.
        shard_size: ranks one parameter is sharded over (the inner dimension
            of a ``(replicate, shard)`` mesh). (Default: ``None``: the world size)
    """
    shard = shard_size or world_size
    if world_size % shard:
        raise ValueError(f"rank_classes: shard_size={shard} must divide world_size={world_size}.")
    # Where the chunk of some parameter changes size: before the index the
    # chunks are full, at it partial (or empty), after it empty.
    cuts = {0, shard}
    for shape, dim in shapes:
        rows = shape[dim] if len(shape) else 1
        for index in (0, shard - 1):
            cuts.add(index)
        chunk = -(-rows // shard)
        if chunk:
            full = rows // chunk
            cuts.update(i for i in (full, full + 1) if 0 <= i <= shard)
    bounds = sorted(cuts)
    classes: list[list[int]] = []
    signature_of: dict[tuple[int, ...], int] = {}
    for start, end in zip(bounds, bounds[1:]):
        if start == end:
            continue
        signature = tuple(
            chunk_span(shape[dim] if len(shape) else 1, shard, start)[1] for shape, dim in shapes
        )
        at = signature_of.setdefault(signature, len(classes))
        if at == len(classes):
            classes.append([])
        classes[at].extend(range(start, end))
    replicas = world_size // shard
    return [sorted(r * shard + i for r in range(replicas) for i in members) for members in classes]
