"""Saves that finish in the background: the handle :func:`save(...,
async_mode=True) <shardwise.checkpoint.save>` returns, the process group
their collectives use, and the one save a process may have in flight.

[Note: background saves]
An async save does in the caller's thread only what must see the live
tensors: rank 0 prepares the staging directory (and writes ``extra``), every
rank takes its state dicts and *stages* them, i.e. copies its shards into
fresh CPU tensors with DCP's own stager (``FileSystemWriter.stage``, a
``BlockingAsyncStager``: exact-size tensors, so no view of a larger storage
reaches the writer), and the ranks agree that staging worked. Then
``torch.distributed.checkpoint.async_save`` writes the staged copy from
DCP's writer thread, and a thread of ours waits for it and runs the rest of
the commit protocol ([Note: commit protocol] in commit.py): checksums,
gathered to rank 0, which renames and writes the marker. The checkpoint is
visible to ``latest`` only after that, exactly as for a blocking save; a
process killed meanwhile leaves a ``.tmp-`` directory that nothing accepts.

Collectives of the background threads run on a process group of their own
(gloo, created once on the first async save: ``new_group`` is collective, and
the save is too). On the default group they would interleave with the
training's collectives in a different order on different ranks. DCP's
thread and ours never use the group at the same time (ours waits for DCP's),
and a save waits for the one before it, so the group carries one save at a
time, in the same order on every rank.

At most one save is in flight per process: :func:`save` and :func:`load`
wait for it first. A failure of that save that nobody saw yet (through
:meth:`AsyncSave.wait`) is raised by the next ``save``: a training loop that
never waits learns at its next checkpoint that the last one failed, as it
would have at once with a blocking save. ``load`` only logs it (the earlier
checkpoints it would load are intact).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import logging
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.checkpoint.ranks import is_distributed

__all__ = ["AsyncSave", "checkpoint_group", "start", "wait_pending"]

log = logging.getLogger("shardwise.checkpoint")

# the checkpoint group: remade when it is no longer registered (the user's
# destroy_process_group() destroyed it with the default group)
_GROUP: ProcessGroup | None = None
# the save in flight in this process, if any
_PENDING: AsyncSave | None = None


class AsyncSave:
    """A checkpoint being written in the background, returned by
    ``shardwise.checkpoint.save(..., async_mode=True)``.

    The state was copied when ``save`` returned, so training may go on and
    change the model and optimizer at once. The checkpoint becomes visible
    (to :func:`~shardwise.checkpoint.latest` and
    :func:`~shardwise.checkpoint.load`) only when every rank's shards and
    the completion marker are on disk; until then ``latest`` returns the
    previous checkpoint. Call :meth:`wait` on every rank before the process
    group is destroyed; the next ``save`` or ``load`` waits too.

    Attributes:
        path: the directory the checkpoint is committed to.
    """

    def __init__(self, path: Path, future: concurrent.futures.Future[None]) -> None:
        self.path = path
        self._future = future
        self._seen = False  # its outcome reached the caller (wait() returned or raised)

    def done(self) -> bool:
        """Whether the background write has ended (committed or failed); no communication."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is committed, and return its directory.

        Args:
            timeout: seconds to wait at most; ``TimeoutError`` if the save is
                still running then (it goes on). (Default: ``None``: no limit)

        Raises:
            CheckpointError: the save failed (on every rank alike); nothing
                of it is visible, earlier checkpoints are intact, and its
                staging directory is removed.
        """
        try:
            self._future.result(timeout)
        finally:
            self._seen = self._seen or self._future.done()  # not after a timeout: the outcome is still to come
        return self.path

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "committed")
        return f"AsyncSave({str(self.path)!r}, {state})"


def checkpoint_group() -> ProcessGroup | None:
    """The process group of background saves (``None`` without a default
    group). Collective the first time: call on every rank.

    Only the checkpoint group itself is kept, never the default group: a
    reference to the default group would keep its gloo threads alive past the
    user's ``destroy_process_group()``. Nor is a destroyed checkpoint group
    kept until the interpreter finalises (see :func:`_forget_group`).
    """
    global _GROUP
    if not is_distributed():
        return None
    if _GROUP is not None and _GROUP not in dist.distributed_c10d._world.pg_map:
        _GROUP = None  # destroyed with the default group; a new default group gets a new one
    if _GROUP is None:
        group = dist.new_group(backend="gloo")
        if group is None:  # pragma: no cover - every rank is a member
            raise AssertionError(f"rank {dist.get_rank()}: new_group returned None for the whole world")
        _GROUP = group
    return _GROUP


@atexit.register
def _forget_group() -> None:
    """At exit, before the interpreter finalises: drop the checkpoint group.

    If the user destroyed the process groups, ours was only unregistered and
    this reference was the last one; dropping it here destroys it while other
    threads may still take the GIL. Left to finalisation, its gloo worker
    threads could still be releasing the last collective's tensors, which
    needs the GIL, and a thread that asks for the GIL while the interpreter
    finalises is ended in the middle of C++ code: the process aborts
    ("terminate called without an active exception") after the run finished.
    """
    global _GROUP
    if _GROUP is not None:
        _GROUP = None
        gc.collect()


def start(path: Path, finish: Callable[[], None]) -> AsyncSave:
    """Run ``finish`` (wait for DCP's write, then commit) in a thread of its
    own and make its handle the one in flight."""
    global _PENDING
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-checkpoint")
    future = executor.submit(finish)
    executor.shutdown(wait=False)  # the thread ends with the save
    _PENDING = AsyncSave(path, future)
    return _PENDING


def wait_pending(*, raise_unseen: bool) -> None:
    """Wait for this process's save in flight, if any. If it failed and
    nobody saw its error yet: raise it (``raise_unseen``), else log it."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return
    seen = pending._seen
    try:
        pending.wait()
    except BaseException as exc:
        if seen:
            return
        if raise_unseen:
            raise
        log.error("the background save of %s failed: %s: %s", pending.path, type(exc).__name__, exc)
