"""The local launcher's watch over its ranks: when one fails, stop the
others and say, in one message, which rank, how (a signal, an exit status,
an exception: its traceback once; the watchdog: its report), at which step,
and where the run can continue from.

[Note: which rank failed first]
A rank that dies takes its sockets with it, so the ranks waiting on it in a
collective fail a moment later ("Connection closed by peer"); by the time
the launcher looks, several may have exited. The cause is, in this order:
the watchdog's report, if one ended the run (its ranks exit with
``shardwise.watchdog.EXIT_CODE`` and the report is in the store); a rank
killed by a signal the launcher did not send; the rank that raised first (a
rank that raises claims ``shardwise/failed`` on the store with an atomic
``add`` *before* its exception ends it, so before its peers can fail in
turn); else the lowest rank with a non-zero exit status.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import Store

from shardwise.errors import ShardwiseError
from shardwise.watchdog import EXIT_CODE, RankRecord, read_records, read_report

__all__ = ["RunFailed", "checkpoint_hint", "explain_failure", "mark_failed", "supervise"]

_FAILED = "shardwise/failed"


class RunFailed(ShardwiseError, RuntimeError):
    """A rank of a ``shardwise train`` run failed and the run was stopped; the
    message says which rank, how, at which step, and how to continue.

    Args:
        message: the whole message.
        exit_code: the status the command should exit with.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def mark_failed(store: Store, rank: int) -> int | None:
    """Claim "first to fail" for ``rank`` if no rank has (call before the exception ends the rank);
    returns the rank that did (``None`` if the store cannot tell)."""
    try:
        if store.add(_FAILED, 1) == 1:
            store.set(_FAILED + "/first", str(rank))
            return rank
        deadline = time.monotonic() + 2.0
        while not store.check([_FAILED + "/first"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(store.get(_FAILED + "/first"))
    except Exception:  # noqa: BLE001 - a failing rank must fail with its own exception, not the store's
        return None


def explain_failure(rank: int, first: int | None, gone: list[RankRecord], exc: BaseException,
                    hint: str) -> RunFailed | None:
    """Under torchrun, where each rank's error file is all that is said of it: if ``exc`` only follows
    another rank's failure (a rank that raised first, or one whose process is ``gone``, killed by a
    signal), a :class:`RunFailed` that says so in one line; ``None`` if ``exc`` is this rank's own.

    Args:
        rank: this rank.
        first: the rank that claimed the first failure (:func:`mark_failed`).
        gone: the other ranks whose processes have exited (``shardwise.watchdog.Watchdog.gone``).
        exc: what this rank raised.
        hint: where the run can continue from (:func:`checkpoint_hint`).
    """
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0][:200]  # gloo's "[path:line] What. Advice."
    then = f"rank {rank} then failed ({type(exc).__name__}: {text})"
    if first is not None and first != rank:
        return RunFailed(f"rank {first} raised an exception first (its traceback is in its error file); {then}; "
                         f"{hint}", 1)
    if gone:
        rec = gone[0]
        at = f" at step {rec.step}" if rec.step is not None else ""
        return RunFailed(f"rank {rec.rank} (pid {rec.pid}) exited{at} without an exception (killed by a signal?); "
                         f"{then}; {hint}", 1)
    return None


def checkpoint_hint(checkpoint_dir: str, checkpointing: bool) -> str:
    """Where the run can continue from: the last complete checkpoint in ``checkpoint_dir``, if any."""
    from shardwise.checkpoint import latest

    found = latest(checkpoint_dir) if Path(checkpoint_dir).is_dir() else None
    if found is not None:
        return f"the last complete checkpoint is {found}: rerun with --resume"
    if checkpointing:
        return f"no checkpoint was complete yet in {checkpoint_dir}: rerun to start over"
    return "no checkpoints were being saved (--checkpoint-every 0): rerun to start over"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _state(pid: int | None) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stop(processes: list[Any], grace: float = 3.0) -> None:
    """SIGTERM every live rank (SIGKILL a stopped one at once: it would not act on SIGTERM), then SIGKILL
    what is left after ``grace`` seconds."""
    for p in processes:
        if p.exitcode is None:
            if _state(p.pid) in ("T", "t"):
                p.kill()
            else:
                p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.exitcode is None:
            p.kill()
        p.join()


def _read(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - the store is ours, but never let reading it hide the failure
        return None


def supervise(context: Any, store: Store, world_size: int, hint: Callable[[], str]) -> None:
    """Wait for the ranks of ``context`` (``torch.multiprocessing.start_processes(..., join=False)``);
    return when all exit 0. On the first failure stop the others and raise :class:`RunFailed`; see
    [Note: which rank failed first]. On Ctrl-C stop them and re-raise.

    Args:
        context: the ranks' process context.
        store: the launcher's store, which the ranks and their watchdogs write to.
        world_size: the number of ranks.
        hint: where the run can continue from (called after the ranks are stopped).
    """
    processes: list[Any] = list(context.processes)
    try:
        while True:
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                break
            alive = [p for p in processes if p.exitcode is None]
            if not alive:
                return
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
    except KeyboardInterrupt:
        _stop(processes)
        raise
    codes = {r: p.exitcode for r, p in enumerate(processes)}  # before we stop anyone
    report = _read(lambda: read_report(store))
    records = _read(lambda: read_records(store, world_size)) or {}
    first = _read(lambda: store.get(_FAILED + "/first") if store.check([_FAILED + "/first"]) else None)
    _stop(processes)
    after = hint()
    others = "the other ranks were stopped"
    if report is not None:
        raise RunFailed(f"{report}\nevery rank was stopped (exit status {EXIT_CODE}); {after}", EXIT_CODE)

    def at(rank: int) -> str:
        rec = records.get(rank)
        return f" at step {rec.step}" if rec is not None and rec.step is not None else ""

    signalled = [r for r, c in codes.items() if c is not None and c < 0]
    if signalled:
        r = signalled[0]
        raise RunFailed(f"rank {r} exited with {_signal_name(codes[r] or 0)}{at(r)}; {others}; {after}", 1)
    rank = int(first) if first is not None else min(r for r, c in codes.items() if c not in (None, 0))
    error_file = context.error_files[rank]
    trace = None
    if os.access(error_file, os.R_OK):
        try:
            with open(error_file, "rb") as fh:
                trace = pickle.load(fh)
        except Exception:  # noqa: BLE001
            trace = None
    for path in context.error_files:
        try:
            os.unlink(path)
        except OSError:
            pass
    if trace is not None:
        raise RunFailed(f"rank {rank} raised an exception{at(rank)}; {others}; {after}\n"
                        f"{str(trace).rstrip()}", 1)
    raise RunFailed(f"rank {rank} exited with status {codes[rank]}{at(rank)}; {others}; {after}", 1)
