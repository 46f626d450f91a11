"""Rank helpers for checkpointing: they also work without a process group
(one process: rank 0 of 1), and :func:`agree` makes every rank fail together.

[Note: failing together]
Checkpoint code checks files and models between collectives. If one rank
raised while the others went on into the next collective, they would hang
until the process group's timeout. So every check whose outcome may differ
between ranks (a file read, a disk error) is followed by :func:`agree`: the
ranks exchange what went wrong, and if anything did, every rank raises (the
rank that failed re-raises its own exception; the others raise
:class:`CheckpointError` quoting it).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.errors import CheckpointError

T = TypeVar("T")

__all__ = ["agree", "all_gather_object", "broadcast_object", "is_distributed", "rank", "world_size"]


def is_distributed() -> bool:
    """Whether a default process group exists (else: one process, rank 0 of 1)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def broadcast_object(obj: T, group: ProcessGroup | None = None) -> T:
    """Rank 0's ``obj`` on every rank (of ``group``: default, the world)."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_object(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's ``obj`` (of ``group``: default, the world), in rank order."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: BaseException | None, group: ProcessGroup | None = None) -> None:
    """Raise on every rank (of ``group``: default, the world) if ``error`` is
    set on any (see [Note: failing together])."""
    messages = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    for r, msg in enumerate(messages):
        if msg is not None:
            raise CheckpointError(f"rank {r} failed: {msg}")
