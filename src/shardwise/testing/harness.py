"""Run a function on every rank of a gloo process group, from pytest.

The harness keeps one pool of worker processes per world size. A pool is
started the first time a test asks for its world size and is then reused by
every later test of the pytest session, so a test pays for a task round trip
(about a millisecond), not for starting processes and importing torch.

Each worker is a daemonic process from the ``forkserver`` start method
(``spawn`` where there is none): a server process, started with the first
pool, imports torch and the worker's module once, and every worker of every
pool is forked from it, so a pool starts in well under a second instead of
each worker importing torch anew (seconds each). The server, and so every
worker, has the environment of the pytest process when the first pool
started, with ``OMP_NUM_THREADS=1``; ``sys.path`` is the current one at each
start. A worker runs with one intra-op thread, joins the default process
group (backend ``"gloo"``, on 127.0.0.1, through a TCPStore that the parent
process hosts on a port the operating system picks) and then serves tasks:
import a module, look up a module-level function, call it with keyword
arguments, send back its return value. After every task that succeeded the
ranks meet in ``dist.barrier()`` so that one test cannot bleed into the next,
and then destroy every process group the task left (all but the default one),
with shardwise's and DTensor's caches that hold them: an idle gloo group's
event loop wakes 100 times a second, and a session's tests create hundreds.

When a task fails on any rank the harness waits :data:`GRACE_PERIOD_S` seconds
for the other ranks; a rank that has not finished by then is presumed hung in
a collective whose peer is gone. The harness then records the Python stack of
every hung rank, kills the whole pool (the next test starts a fresh one) and
raises :class:`RankFailure` with each rank's traceback. A task that runs past
its timeout, and a worker process that dies, are handled the same way.

Two entry points:

* :func:`run_on_ranks` runs a module-level function on every rank and returns
  the per-rank return values.
* :func:`multi_rank` turns a module-level test function into a pytest test
  whose body runs on every rank, parametrized over world sizes.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from shardwise.testing._worker import (
    _DIED,
    _ERROR,
    _OK,
    _RANK_FN_PREFIX,
    _SKIP,
    _XFAIL,
    STARTUP_TIMEOUT_S,
    _trim_stack_dump,
    _worker_main,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GRACE_PERIOD_S",
    "STARTUP_TIMEOUT_S",
    "RankFailure",
    "multi_rank",
    "run_on_ranks",
]

T = TypeVar("T")

#: Seconds a task may run before the harness gives up on it (per call).
DEFAULT_TIMEOUT_S: float = 120.0
#: Seconds the harness waits for the other ranks once one rank has failed.
#: Read at every call, so a test may monkeypatch it.
GRACE_PERIOD_S: float = 5.0

_HOST = "127.0.0.1"
# Environment the workers inherit at start (through the fork server, which
# imports torch): OpenMP reads it when torch loads, before any code of ours runs.
_SPAWN_ENV = {"OMP_NUM_THREADS": "1"}
# Seconds to wait for a hung rank's stack dump after signalling it.
_STACK_DUMP_WAIT_S = 1.0
# Seconds a pool's workers get to leave on their own at shutdown.
_SHUTDOWN_WAIT_S = 2.0



class RankFailure(AssertionError):
    """A task failed, hung, timed out or lost its process on one or more ranks.

    The message holds, for every rank that did not succeed, a section headed
    ``rank r`` with its full traceback or what happened to it.

    Attributes:
        errors: Traceback text (or a description of the worker's death) per
            rank that failed.
        unfinished: Ranks that had not finished when the harness gave up.
        timed_out: Whether the harness gave up because the task timed out.
    """

    def __init__(
        self,
        message: str,
        *,
        errors: dict[int, str] | None = None,
        unfinished: Sequence[int] = (),
        timed_out: bool = False,
    ) -> None:
        """Create the exception.

        Args:
            message: The full, human-readable report.
            errors: Traceback text per failed rank. (Default: ``None``, none)
            unfinished: Ranks that did not finish. (Default: ``()``)
            timed_out: Whether the task timed out. (Default: ``False``)
        """
        super().__init__(message)
        self.errors: dict[int, str] = dict(errors or {})
        self.unfinished: tuple[int, ...] = tuple(unfinished)
        self.timed_out = timed_out


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def run_on_ranks(
    fn: Callable[..., T],
    world_size: int,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(**kwargs)`` on every rank of a ``world_size`` gloo group.

    The call blocks until every rank has returned, and uses (starting it on
    first use) the session-wide worker pool for ``world_size``. Inside ``fn``
    the default process group is initialized; ``dist.get_rank()`` and
    ``dist.get_world_size()`` say where it runs. Before each task a worker
    resets torch to one intra-op thread, grad mode on and float32 as the
    default dtype; it does not seed torch's generators: ``fn`` seeds what it
    needs. After it, the ranks destroy every process group ``fn`` created (all
    but the default group): a group kept in a module global does not reach the
    next call. Worker processes are daemonic, so ``fn`` cannot start processes
    of its own (``DataLoader(num_workers=0)`` only).

    Args:
        fn: A module-level function (not a lambda, closure or method); for a
            :func:`multi_rank` test, its undecorated body runs. The workers
            import its module by name, or from the module's file.
        world_size: Number of ranks, 1 or more.
        timeout: Seconds the task may run before all ranks are killed and
            :class:`RankFailure` is raised. (Default: ``120.0``)
        **kwargs: Keyword arguments for ``fn``; they must be picklable. The
            names ``fn``, ``world_size`` and ``timeout`` are taken by this
            function and cannot be forwarded.

    Returns:
        The return values of ``fn``, indexed by rank. They must be picklable.

    Raises:
        RankFailure: If ``fn`` raised on any rank, a rank hung after another
            failed, the task timed out or a worker process died. The pool of
            that world size is killed; the next call starts a new one.
        TypeError: If ``fn`` cannot be located by the workers or ``kwargs``
            cannot be pickled.
        ValueError: If ``world_size`` or ``timeout`` is out of range.
    """
    __tracebackhide__ = True
    return _dispatch(fn, world_size, timeout, kwargs)


def multi_rank(
    world_sizes: Sequence[int] = (2,),
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Make a module-level test function run on every rank, per world size.

    The decorated function becomes a pytest test, run in the pytest process,
    that is parametrized over ``world_size`` (ids ``ws1``, ``ws2``, ...) and
    dispatches the original function to the worker pool of that world size
    with all of its arguments. Its signature is the original's, so
    ``@pytest.mark.parametrize`` stacked above (or below) keeps working, and
    fixtures whose values can be pickled (``tmp_path``, ...) reach the ranks.
    ``world_size`` is passed to the original only if it takes a parameter of
    that name (or ``**kwargs``); otherwise it is added to the test's signature
    for pytest alone.

    Example::

        @pytest.mark.parametrize("reshard", [True, False])
        @multi_rank(world_sizes=(1, 2, 4))
        def test_something(world_size, reshard):
            assert dist.get_world_size() == world_size

    Assertions in the body are rewritten by pytest in the workers too, so a
    failing ``assert`` shows its operands in the rank's traceback.

    Args:
        world_sizes: World sizes to run the test with, each 1 or more.
            (Default: ``(2,)``)
        timeout: Seconds each run may take before its ranks are killed and
            the test fails. (Default: ``120.0``)

    Returns:
        A decorator that takes the test function and returns the pytest test.

    Raises:
        ValueError: If ``world_sizes`` is empty or holds a size below 1, or
            ``timeout`` is not positive.
        TypeError: At decoration, if the function is not a module-level
            function.
    """
    sizes = tuple(_check_world_size(size) for size in world_sizes)
    if not sizes:
        raise ValueError("multi_rank needs at least one world size")
    timeout = _check_timeout(timeout)

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        import pytest

        _check_module_level(fn)
        signature = inspect.signature(fn)
        params = signature.parameters
        takes_world_size = "world_size" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        # Reachable by the workers although the module attribute named after
        # the test will be the wrapper.
        fn.__globals__[_RANK_FN_PREFIX + fn.__name__] = fn

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> None:
            __tracebackhide__ = True
            world_size = kwargs["world_size"]
            if not takes_world_size:
                del kwargs["world_size"]
            _dispatch(fn, world_size, timeout, kwargs)

        wrapper.__signature__ = _signature_with_world_size(signature)  # type: ignore[attr-defined]
        wrapper._shardwise_rank_fn = fn  # type: ignore[attr-defined]
        parametrize = pytest.mark.parametrize(
            "world_size", sizes, ids=[f"ws{size}" for size in sizes]
        )
        marked: Callable[..., None] = parametrize(wrapper)
        return marked

    return decorate


# --------------------------------------------------------------------------
# Dispatch (pytest process)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """Where the workers find a function: module name, file, attribute."""

    module_name: str
    file_path: str | None
    qualname: str
    rewrite_asserts: bool
    display_name: str


_POOLS: dict[int, _Pool] = {}
_POOLS_LOCK = threading.RLock()
_atexit_registered = False


def _dispatch(
    fn: Callable[..., T], world_size: int, timeout: float, kwargs: dict[str, Any]
) -> list[T]:
    """Run ``fn(**kwargs)`` on the pool for ``world_size``; see run_on_ranks."""
    __tracebackhide__ = True
    world_size = _check_world_size(world_size)
    timeout = _check_timeout(timeout)
    # A multi_rank test passed here: run its body, not the dispatching wrapper.
    fn = getattr(fn, "_shardwise_rank_fn", fn)
    target = _locate(fn)
    try:
        kwargs_bytes = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"the arguments for {target.display_name} must be picklable to reach the "
            f"ranks: {exc!r}"
        ) from exc
    with _POOLS_LOCK:
        pool = _get_pool(world_size)
        try:
            return pool.run(target, kwargs_bytes, timeout)
        except RankFailure as exc:
            if os.environ.get(RERUN_CRASHED_ENV, "0") in ("", "0") or not _crashed(exc):
                raise
            crash = str(exc)
    # [Note: a crashed rank reruns once] (only where RERUN_CRASHED_ENV asks for it)
    import warnings

    warnings.warn(
        f"{target.display_name}: a rank died of a fatal signal; run once more on fresh workers "
        f"({RERUN_CRASHED_ENV}=1). The crash:\n{crash}",
        RuntimeWarning,
        stacklevel=2,
    )
    with _POOLS_LOCK:
        return _get_pool(world_size).run(target, kwargs_bytes, timeout)


# [Note: a crashed rank reruns once]
# Five times in twenty-five sessions one rank of a suite run died of a damaged
# heap (glibc's "malloc(): unaligned tcache chunk detected") inside one of
# PyTorch's functional collectives over gloo (DTensor's full_tensor or a
# redistribute's reduce-scatter), never in the engine's own code; it never
# came back when the test ran again, and it survived every search (glibc's
# debugging allocator, AddressSanitizer, a check that no engine buffer is
# freed under a collective in flight: docs/decisions.md). With
# SHARDWISE_TEST_RERUN_CRASHED=1 (this project's tests/conftest.py sets it) a
# task whose rank died of a fatal signal runs once more, on fresh workers,
# with a warning that carries the whole crash report; a second crash fails
# the test. Exceptions, assertions, hangs and timeouts are never rerun.
RERUN_CRASHED_ENV = "SHARDWISE_TEST_RERUN_CRASHED"
_FATAL = tuple(
    f"worker process died (killed by {name})" for name in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")
)


def _crashed(exc: RankFailure) -> bool:
    """Whether a rank of the failed task died of a fatal signal (and none timed out)."""
    return not exc.timed_out and any(text.startswith(_FATAL) for text in exc.errors.values())


def _get_pool(world_size: int) -> _Pool:
    """Return the live pool for ``world_size``, starting one if needed."""
    global _atexit_registered
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is not None and not pool.healthy():
            pool.kill()
            pool = None
        if pool is None:
            if not _atexit_registered:
                atexit.register(_shutdown_pools)
                _atexit_registered = True
            pool = _Pool(world_size)
            _POOLS[world_size] = pool
        return pool


def _shutdown_pools() -> None:
    """Stop every pool; registered with :mod:`atexit`."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _check_world_size(world_size: int) -> int:
    """Return ``world_size`` if it is an int of at least 1, else raise."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    return world_size


def _check_timeout(timeout: float) -> float:
    """Return ``timeout`` as a float if it is positive, else raise."""
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return float(timeout)


def _check_module_level(fn: Callable[..., Any]) -> None:
    """Raise TypeError unless ``fn`` is a plain module-level function."""
    if not inspect.isfunction(fn):
        raise TypeError(f"expected a module-level function, got {fn!r}")
    if "." in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise TypeError(
            f"{fn.__qualname__} is not a module-level function; the workers can "
            "only import functions defined at the top level of a module"
        )
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        raise TypeError(f"{fn.__qualname__} must be a plain (not async or generator) function")


def _locate(fn: Callable[..., Any]) -> _Target:
    """Find the module attribute through which the workers can reach ``fn``."""
    _check_module_level(fn)
    module = sys.modules.get(fn.__module__)
    if module is None:
        raise TypeError(f"the module {fn.__module__!r} of {fn.__qualname__} is not imported")
    for attribute in (fn.__qualname__, _RANK_FN_PREFIX + fn.__name__):
        if getattr(module, attribute, None) is fn:
            break
    else:
        raise TypeError(
            f"{fn.__module__}.{fn.__qualname__} is not reachable as an attribute of "
            "its module (was it replaced by a decorator?)"
        )
    loader = getattr(module, "__loader__", None)
    return _Target(
        module_name=module.__name__,
        file_path=getattr(module, "__file__", None),
        qualname=attribute,
        rewrite_asserts=type(loader).__name__ == "AssertionRewritingHook",
        display_name=fn.__qualname__,
    )


def _signature_with_world_size(signature: inspect.Signature) -> inspect.Signature:
    """Return ``signature`` with a ``world_size`` parameter pytest can fill.

    The signature is returned unchanged when it has ``world_size`` without a
    default; otherwise ``world_size`` becomes a keyword-only parameter without
    a default (pytest refuses to parametrize parameters that have one).
    """
    params = list(signature.parameters.values())
    existing = signature.parameters.get("world_size")
    if existing is not None and existing.default is inspect.Parameter.empty:
        return signature
    params = [p for p in params if p.name != "world_size"]
    world_size = inspect.Parameter("world_size", inspect.Parameter.KEYWORD_ONLY)
    position = len(params)
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        position -= 1
    params.insert(position, world_size)
    return signature.replace(parameters=params)


@contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    """The fork server's context, whose server (started with the first worker)
    has imported the worker's module, torch included; ``spawn`` without one."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Read when the server starts (once per session; a server that another user
    # of forkserver started first imports the module in each worker instead).
    ctx.set_forkserver_preload([_worker_main.__module__])
    return ctx


def _describe_exit(exitcode: int | None) -> str:
    """Describe a process exit code in words."""
    if exitcode is None:
        return "worker process died (exit code unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker process died (killed by {name})"
    return f"worker process died (exit code {exitcode})"


class _Pool:
    """``world_size`` worker processes that share one gloo process group."""

    def __init__(self, world_size: int) -> None:
        """Start the workers and wait until they have joined their group."""
        self.world_size = world_size
        self._broken = False
        self._seq = 0
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._dump_paths: list[str] = []
        # The master store lives in this process on a port the OS picks, so
        # concurrent sessions (pytest-xdist, ...) cannot race for a port.
        self._store: TCPStore | None = TCPStore(
            _HOST,
            0,
            None,
            True,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
            wait_for_workers=False,
        )
        try:
            self._start()
        except BaseException:
            self.kill()
            raise

    def _start(self) -> None:
        """Spawn the workers and collect their ``ready`` messages."""
        __tracebackhide__ = True
        if self._store is None:
            raise AssertionError("pool store missing")
        port = self._store.port
        ctx = _start_context()
        with _patched_environ(_SPAWN_ENV):
            for rank in range(self.world_size):
                fd, dump_path = tempfile.mkstemp(
                    prefix=f"shardwise-ws{self.world_size}-rank{rank}-", suffix=".stack"
                )
                os.close(fd)
                self._dump_paths.append(dump_path)
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, port, child_conn, dump_path),
                    name=f"shardwise-ws{self.world_size}-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        while pending and not errors and time.monotonic() < deadline:
            for rank in self._wait(pending, deadline - time.monotonic()):
                pending.discard(rank)
                message = self._recv(rank)
                if message is None:
                    errors[rank] = self._death(rank)
                elif message[0] == "startup-error":
                    errors[rank] = message[1]
                elif message[0] != "ready":
                    errors[rank] = f"unexpected message from worker: {message!r}"
        if errors or pending:
            sections = [f"rank {r}: {text}" for r, text in sorted(errors.items())]
            if pending and not errors:
                sections.append(
                    f"ranks {sorted(pending)} did not join the process group within "
                    f"{STARTUP_TIMEOUT_S:g} s"
                )
            raise RankFailure(
                f"could not start the worker pool for world size {self.world_size}\n\n"
                + "\n\n".join(sections),
                errors=errors,
                unfinished=sorted(pending),
                timed_out=not errors,
            )

    def _wait(self, ranks: set[int], timeout: float) -> list[int]:
        """Wait until some of ``ranks`` sent a message or died; return those."""
        ready: dict[Any, int] = {self._conns[r]: r for r in ranks}
        ready.update({self._procs[r].sentinel: r for r in ranks})
        signalled = multiprocessing.connection.wait(list(ready), timeout=max(0.0, timeout))
        found = {ready[obj] for obj in signalled}
        # Belt and braces for platforms whose sentinels are unreliable.
        found |= {r for r in ranks if not self._procs[r].is_alive()}
        return sorted(found)

    def healthy(self) -> bool:
        """Whether every worker is alive and the pool was never killed."""
        return not self._broken and all(proc.is_alive() for proc in self._procs)

    def run(self, target: _Target, kwargs_bytes: bytes, timeout: float) -> list[Any]:
        """Run one task on all ranks; see :func:`run_on_ranks`."""
        __tracebackhide__ = True
        self._seq += 1
        seq = self._seq
        message = (
            "task",
            seq,
            target.module_name,
            target.file_path,
            target.qualname,
            target.rewrite_asserts,
            kwargs_bytes,
        )
        task = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            values, skipped = self._run(seq, task, target.display_name, timeout)
        except BaseException:
            # RankFailure, or KeyboardInterrupt and friends mid-task.
            if not self._broken:
                self.kill()
            raise
        if skipped is not None:
            # Every rank finished (and met in the barrier): the pool stays.
            _raise_pytest_outcome(*skipped)
        return values

    def _run(
        self, seq: int, task: bytes, name: str, timeout: float
    ) -> tuple[list[Any], tuple[str, str] | None]:
        """Send ``task`` to every rank and gather the outcomes.

        Returns the per-rank values and, if a rank called ``pytest.skip`` or
        ``pytest.xfail``, that outcome and its reason; raises RankFailure.
        """
        __tracebackhide__ = True
        outcomes: dict[int, tuple[str, Any]] = {}
        pending = set(range(self.world_size))
        for rank in range(self.world_size):
            try:
                self._conns[rank].send_bytes(task)
            except OSError:
                outcomes[rank] = (_DIED, self._death(rank))
                pending.discard(rank)

        deadline = time.monotonic() + timeout
        grace = float(GRACE_PERIOD_S)
        grace_deadline: float | None = None
        first_failed: int | None = None
        if outcomes:
            first_failed = min(outcomes)
            grace_deadline = time.monotonic() + grace
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for rank in self._wait(pending, remaining):
                outcome = self._receive_result(rank, seq)
                if outcome is None:
                    continue
                outcomes[rank] = outcome
                pending.discard(rank)
                if outcome[0] in (_ERROR, _DIED) and grace_deadline is None:
                    first_failed = rank
                    grace_deadline = time.monotonic() + grace

        statuses = {status for status, _ in outcomes.values()}
        if not pending and statuses <= {_OK, _SKIP, _XFAIL}:
            values = [outcomes[rank][1] for rank in range(self.world_size)]
            for rank in range(self.world_size):
                status, payload = outcomes[rank]
                if status in (_SKIP, _XFAIL):
                    return values, (status, f"rank {rank}: {payload}")
            return values, None

        timed_out = bool(pending) and (grace_deadline is None or deadline <= grace_deadline)
        self._fail(name, outcomes, sorted(pending), timeout, grace, first_failed, timed_out)

    def _fail(
        self,
        name: str,
        outcomes: dict[int, tuple[str, Any]],
        unfinished: list[int],
        timeout: float,
        grace: float,
        first_failed: int | None,
        timed_out: bool,
    ) -> NoReturn:
        """Kill the pool and raise RankFailure describing every failed rank."""
        __tracebackhide__ = True
        stacks = self._dump_stacks(unfinished)
        self.kill()
        errors = {
            rank: str(payload)
            for rank, (status, payload) in outcomes.items()
            if status in (_ERROR, _DIED)
        }
        if timed_out:
            headline = (
                f"{name} timed out after {timeout:g} s on world size "
                f"{self.world_size}; ranks that did not finish: "
                + ", ".join(str(r) for r in unfinished)
            )
        else:
            failed = ", ".join(str(r) for r in sorted(errors))
            headline = f"{name} failed on rank {failed} of world size {self.world_size}"
            if unfinished:
                headline += "; hung: rank " + ", ".join(str(r) for r in unfinished)
        sections = [headline]
        for rank in range(self.world_size):
            if rank in errors:
                what = "raised" if outcomes[rank][0] == _ERROR else "died"
                sections.append(f"---- rank {rank} ({what}) ----\n{errors[rank].rstrip()}")
            elif rank in unfinished:
                if timed_out:
                    why = f"still running after {timeout:g} s (timed out)"
                else:
                    why = (
                        f"did not finish within {grace:g} s after rank {first_failed} "
                        "failed (presumed hung in a collective)"
                    )
                stack = stacks.get(rank) or "(no stack dump available)"
                sections.append(
                    f"---- rank {rank} ({why}) ----\nPython stack at the time:\n"
                    + stack.rstrip()
                )
        raise RankFailure(
            "\n\n".join(sections), errors=errors, unfinished=unfinished, timed_out=timed_out
        )

    def _receive_result(self, rank: int, seq: int) -> tuple[str, Any] | None:
        """Read rank's outcome for task ``seq``; None for a stale message."""
        message = self._recv(rank)
        if message is None:
            return (_DIED, self._death(rank))
        if message[0] != "result" or message[1] != seq:
            return None
        _, _, status, payload = message
        if status != _OK:
            return (status, payload)
        try:
            return (_OK, pickle.loads(payload))
        except Exception:
            return (
                _ERROR,
                "could not unpickle the return value in the pytest process:\n"
                + traceback.format_exc(),
            )

    def _recv(self, rank: int) -> tuple[Any, ...] | None:
        """Read one message from ``rank``; None if its process is gone."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return None
            message: tuple[Any, ...] = pickle.loads(conn.recv_bytes())
            return message
        except (EOFError, OSError):
            return None

    def _death(self, rank: int) -> str:
        """How rank's process died; after a fatal signal (SIGSEGV, ...), with
        the Python stacks faulthandler wrote as it died."""
        text = _describe_exit(self._exitcode(rank))
        stack = _trim_stack_dump(self._dump_text(rank))
        if stack:
            text += "\nPython stack at the time:\n" + stack.rstrip()
        return text

    def _exitcode(self, rank: int) -> int | None:
        """Exit code of rank's process, waiting briefly for it to be reaped."""
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return proc.exitcode

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask live workers in ``ranks`` for their Python stacks (SIGUSR1)."""
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return {}
        asked = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except OSError:
                    continue
                asked.append(rank)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while asked and time.monotonic() < deadline:
            for rank in list(asked):
                text = self._dump_text(rank)
                if text:
                    stacks[rank] = text
                    asked.remove(rank)
            if asked:
                time.sleep(0.02)
        if stacks:
            time.sleep(0.05)  # let a dump in progress finish, then reread
            for rank in stacks:
                stacks[rank] = self._dump_text(rank) or stacks[rank]
        return {rank: _trim_stack_dump(text) for rank, text in stacks.items()}

    def _dump_text(self, rank: int) -> str:
        """What faulthandler has written to rank's stack-dump file ("" if nothing)."""
        try:
            return Path(self._dump_paths[rank]).read_text(errors="replace")
        except (OSError, IndexError):
            return ""

    def kill(self) -> None:
        """Kill every worker at once and release the pool's resources."""
        self._broken = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
        self._release()

    def close(self) -> None:
        """Ask every worker to leave, then kill those that do not."""
        if not self._broken:
            stop = pickle.dumps(("stop",))
            for conn in self._conns:
                try:
                    conn.send_bytes(stop)
                except OSError:
                    pass
            deadline = time.monotonic() + _SHUTDOWN_WAIT_S
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        """Close pipes, drop the store, delete the stack-dump files."""
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._store = None
        for path in self._dump_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._dump_paths = []
        with _POOLS_LOCK:
            if _POOLS.get(self.world_size) is self:
                del _POOLS[self.world_size]


def _raise_pytest_outcome(status: str, reason: str) -> NoReturn:
    """Re-raise a rank's ``pytest.skip``/``pytest.xfail`` in this process."""
    __tracebackhide__ = True
    import pytest

    if status == _SKIP:
        pytest.skip(reason)
    pytest.xfail(reason)


