"""A watchdog that ends a distributed run which stopped making progress,
with one message naming the stuck rank(s), what every rank was waiting on,
and the stuck rank's Python stack where it can be had.

Start one on every rank, after ``init_process_group``::

    from shardwise.watchdog import Watchdog

    with Watchdog(timeout=300) as wd:
        for step in range(1, steps + 1):
            wd.step(step)
            train_step()

``shardwise train`` starts one on each rank (``--watchdog-timeout``, TOML
``watchdog_timeout``; ``0`` turns it off).

[Note: watchdog]
*Progress.* Each rank keeps an in-memory record of where it is: the step
(:meth:`Watchdog.step`), the phase, the innermost engine region (the
watchdog is a :mod:`shardwise.observe` observer, so every all-gather,
reduce-scatter and forward/backward hook of the engine counts as one event
and says which group it is for) or a collective declared with
:meth:`Watchdog.collective`, and an event counter. A background thread
publishes the record to the process group's store every ``interval``
seconds with a beat counter that advances whenever the thread runs; the
training thread itself never touches the store.

*Who is stuck.* A rank whose own record has not changed for ``timeout / 2``
takes a snapshot of every rank's record; once it has made no progress for
``timeout`` it takes a second one and judges:

1. a rank whose beat did not advance between the snapshots (at least
   ``timeout / 2`` apart) does not run at all: stopped (SIGSTOP), dead, or
   hung holding the interpreter lock. The run ends.
2. else, if this rank waits in a collective, a rank that has made no progress
   either, runs, and is neither in a collective nor busy (blocked in a data
   loader, on a lock, in a collective the engine does not know) is stuck; so
   is a rank that has stopped its watchdog. The run ends.
3. else, if every rank waits in a collective and none progresses, the ones
   not in the collective most ranks are in are stuck (all of them, when all
   wait in the same one). The run ends.

Otherwise the ranks that keep this one waiting are *busy* (inside
:meth:`Watchdog.busy`, e.g. a long checkpoint save, or in their first step:
lazy initialisation, compilation): the watchdog logs a warning once per
``timeout`` and lets the run go on. A long save or a slow first step pauses
every rank's progress alike and no rank is ahead, so nothing fires; a busy
machine slows every rank but none stops, so nothing fires; a pause of the
whole job (Ctrl-Z) is seen by each watchdog thread as a gap in its own
clock, which restarts its count.

*Ending the run.* The first rank to decide claims the report (an atomic
``add`` on the store), asks the running stuck ranks for their stacks (their
watchdog threads write the training thread's stack to the store), writes the
message to the store (:func:`read_report`) and to ``on_timeout``, kills a
stuck rank that is stopped on its own host (a stopped process cannot end
itself, not even on SIGTERM), and every rank exits with :data:`EXIT_CODE`
(``os._exit``: the training threads are blocked in collectives). Store
operations run on a separate connection with a short timeout and never hang
the thread.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

import shardwise.observe as observe
from shardwise.errors import MIN_TIMEOUT, ConfigError, UsageError

__all__ = [
    "EXIT_CODE",
    "MIN_TIMEOUT",
    "RankRecord",
    "Watchdog",
    "WatchdogReport",
    "active",
    "busy",
    "collective",
    "phase",
    "read_records",
    "read_report",
    "step",
]

log = logging.getLogger("shardwise.watchdog")

EXIT_CODE = 124
"""The exit status of every rank of a run the watchdog ended (as ``timeout(1)``'s)."""

_PREFIX = "shardwise/watchdog/"
_STEP_POLL = 0.1  # seconds between looks at the step between publications
# Engine regions that do not wait on other ranks (a rank stalled inside one is not "waiting").
_LOCAL_REGIONS = frozenset({"post_forward", "reshard_post_forward", "prefetch"})


@dataclass(frozen=True)
class RankRecord:
    """What a rank last published: where it is and whether it runs."""

    rank: int
    pid: int
    host: str
    start: str  # the process's start time (``/proc``), so a pid is not mistaken for a reused one
    beat: int  # advances each time the watchdog thread runs
    events: int  # advances with every engine event, step and phase: the rank's progress
    step: int | None
    phase: str | None
    where: str | None  # the innermost region, e.g. "all_gather (blocks.1)"
    waiting: bool  # in a collective (an engine region or a declared one)
    busy: str | None  # a declared long phase, or "first step"
    stalled: float  # seconds without progress, by the rank's own clock
    done: bool  # the watchdog was stopped (the rank left the run or finished)

    def position(self) -> str:
        """Where the rank is, in words."""
        parts = [f"step {self.step}" if self.step is not None else "before the first step"]
        if self.phase:
            parts.append(self.phase)
        parts.append(f"in {self.where}" if self.where else "outside any collective")
        if self.busy:
            parts.append(f"busy: {self.busy}")
        return ", ".join(parts) + f", event {self.events}"

    @staticmethod
    def from_json(raw: bytes) -> RankRecord:
        """The record published as ``raw``."""
        return RankRecord(**json.loads(raw))


@dataclass(frozen=True)
class WatchdogReport:
    """What ``on_timeout`` receives when the watchdog ends the run."""

    message: str  # the whole report, several lines
    stuck: tuple[int, ...]  # the ranks named as stuck
    reporter: bool  # this rank composed the message (log it here, once for the run)


@dataclass(frozen=True)
class _Verdict:
    stuck: tuple[int, ...]
    reason: str


def _start_token() -> str:
    try:
        with open("/proc/self/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _process_state(rec: RankRecord) -> str | None:
    """``rec``'s process state from ``/proc`` (``"T"`` stopped, ``"Z"``, ...), ``"gone"``, or
    ``None`` if it cannot be seen from here (another host)."""
    if rec.host != socket.gethostname() or not rec.start:
        return None
    try:
        with open(f"/proc/{rec.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    if fields[19] != rec.start:
        return "gone"
    return fields[0]


def _not_running_text(rec: RankRecord | None) -> str:
    if rec is None:
        return "never reported (its watchdog did not start, or it hangs before)"
    state = _process_state(rec)
    where = f"pid {rec.pid}"
    if state == "T":
        return f"{where} is stopped (SIGSTOP or job control; no Python stack: the process does not run)"
    if state == "t":
        return f"{where} is stopped by a debugger (no Python stack: the process does not run)"
    if state in ("gone", "Z", "X"):
        return f"{where} has exited"
    if state is None:
        return (f"{where} on {rec.host} has not been heard from (stopped, dead, or its host is down; "
                "no Python stack)")
    return (f"{where} runs but its watchdog thread does not (hung in native code holding the interpreter "
            "lock, or the machine is overloaded; no Python stack)")


class Watchdog:
    """Ends the run when a rank has waited ``timeout`` seconds on another
    that makes no progress; see [Note: watchdog] in this module.

    Start it on every rank after ``init_process_group`` (``start()`` or
    ``with``), call :meth:`step` at each training step, and mark long phases
    that may keep other ranks waiting (a checkpoint save on one rank) with
    :meth:`busy` and collectives issued outside the engine with
    :meth:`collective`. The module-level :func:`step`, :func:`busy`,
    :func:`collective` and :func:`phase` do the same on the running watchdog
    and nothing when none runs.

    Args:
        timeout: seconds a rank may wait before the run is ended; at least
            :data:`MIN_TIMEOUT`. It must exceed the longest time one rank
            can legitimately keep another waiting outside :meth:`busy` and
            the first step. (Default: ``300``)
        store: where ranks publish their progress. (Default: ``None``: the
            default process group's store)
        rank: this rank. (Default: ``None``: the default process group's)
        world_size: the number of ranks. (Default: ``None``: the default process group's)
        interval: seconds between publications. (Default: ``None``: ``timeout / 20``
            within ``[0.25, 5]``)
        on_timeout: called on every rank with the :class:`WatchdogReport`
            just before it exits. (Default: ``None``: the reporting rank logs
            the message at ``ERROR`` on the ``shardwise.watchdog`` logger)
        exit_code: the exit status of every rank when the run is ended. (Default: :data:`EXIT_CODE`)
    """

    def __init__(
        self,
        timeout: float = 300.0,
        *,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        interval: float | None = None,
        on_timeout: Callable[[WatchdogReport], None] | None = None,
        exit_code: int = EXIT_CODE,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= MIN_TIMEOUT:
            raise ConfigError(
                f"Watchdog(timeout={timeout!r}): the timeout must be a number of seconds >= {MIN_TIMEOUT:g}; "
                "use the time a rank may legitimately wait on another (e.g. 300), or do not start a watchdog"
            )
        if interval is not None and not 0 < interval <= timeout / 4:
            raise ConfigError(
                f"Watchdog(interval={interval!r}) must lie in (0, timeout / 4 = {timeout / 4:g}]: "
                "leave it None for timeout / 20"
            )
        self.timeout = float(timeout)
        self.interval = float(interval) if interval is not None else min(5.0, max(0.25, self.timeout / 20))
        self.on_timeout = on_timeout
        self.exit_code = exit_code
        self._store_arg, self._rank_arg, self._world_arg = store, rank, world_size
        self.rank = -1
        self.world_size = 0
        # The training thread's state: written by it (and the engine's hooks), read by the watchdog thread.
        self._events = 0
        self._step: int | None = None
        self._steps_seen = 0
        self._phase: str | None = None
        self._phase_waits = False
        self._regions: list[tuple[str, str, bool]] = []  # (kind, name, waits on others)
        self._busy: list[str] = []
        # The watchdog thread's state.
        self._store: Store | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watched = 0  # the thread whose stack a report shows
        self._host, self._pid, self._start = "", 0, ""  # who this rank is, for the others' /proc checks
        self._beat = 0
        self._store_failing_since: float | None = None

    # ---- the training thread's side -----------------------------------------------------------------
    def step(self, step: int) -> None:
        """This rank starts training step ``step``."""
        self._step = step
        self._phase, self._phase_waits = None, False
        self._steps_seen += 1
        self._events += 1

    def phase(self, name: str | None, *, waits: bool = False) -> None:
        """This rank enters ``name`` (e.g. ``"forward"``, ``"backward"``, ``"optimizer"``);
        ``waits``: the phase issues collectives outside the engine (``clip_grad_norm_``'s
        all-reduce), so a rank stalled in it, outside any region, waits on the others."""
        self._phase = name
        self._phase_waits = waits
        self._events += 1

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A long phase on this rank that may keep the others waiting
        (``"checkpoint save"``): while inside, a running rank is never
        named as stuck (a stopped one still is)."""
        self._busy.append(what)
        self._events += 1
        try:
            yield
        finally:
            self._busy.pop()
            self._events += 1

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """A collective issued outside the engine (``"all_reduce (loss)"``):
        a rank stalled inside it is waiting on the others."""
        self.enter_region(name, "", waits=True)
        try:
            yield
        finally:
            self.exit_region()

    # shardwise.observe.Observer: the engine's regions are progress events.
    def enter_region(self, kind: str, name: str, *, waits: bool | None = None) -> None:
        """See :class:`shardwise.observe.Observer`."""
        self._regions.append((kind, name, kind not in _LOCAL_REGIONS if waits is None else waits))
        self._events += 1

    def exit_region(self) -> None:
        """See :class:`shardwise.observe.Observer`."""
        if self._regions:
            self._regions.pop()
        self._events += 1

    def storage_resized(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        """See :class:`shardwise.observe.Observer` (not progress: ignored)."""

    def tag(self, category: str, tensors: Iterable[torch.Tensor]) -> None:
        """See :class:`shardwise.observe.Observer` (ignored)."""

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Publish this rank's first record and start watching (idempotent)."""
        global _ACTIVE
        if self._thread is not None:
            return self
        store = self._store_arg
        if store is None or self._rank_arg is None or self._world_arg is None:
            if not dist.is_initialized():
                raise UsageError(
                    "Watchdog.start(): the default process group is not initialised: call "
                    "torch.distributed.init_process_group first, or pass store=, rank= and world_size="
                )
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self.rank = self._rank_arg if self._rank_arg is not None else dist.get_rank()
        self.world_size = self._world_arg if self._world_arg is not None else dist.get_world_size()
        try:  # a connection of our own, whose timeout we may shorten
            own = store.clone()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - stores without clone() (FileStore, HashStore) are used as they are
            own = store
        else:
            own.set_timeout(timedelta(seconds=max(2.0, min(10.0, 2 * self.interval))))
        self._store = own
        self._watched = threading.get_ident()
        self._host, self._pid, self._start = socket.gethostname(), os.getpid(), _start_token()
        self._stopping.clear()
        self._publish(0.0, done=False)
        observe.register(self)
        _ACTIVE = self
        self._thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)
        self._thread.start()
        log.debug("rank %d: watchdog started (timeout %g s, every %g s)", self.rank, self.timeout, self.interval)
        return self

    def stop(self) -> None:
        """Stop watching and tell the other ranks this one left on purpose (idempotent)."""
        global _ACTIVE
        thread, self._thread = self._thread, None
        if thread is None:
            return
        observe.unregister(self)
        if _ACTIVE is self:
            _ACTIVE = None
        self._stopping.set()
        thread.join(timeout=self.interval + 15)
        try:
            self._publish(0.0, done=True)
        except Exception:  # noqa: BLE001 - the store may be gone at the end of a run
            pass

    def gone(self, wait: float = 0.0) -> list[RankRecord]:
        """The other ranks whose processes have exited, as far as this host can see (``/proc``; a rank on
        another host is never listed), with what they last published; e.g. to say, when a collective
        fails, which rank's exit it follows.

        Args:
            wait: look again for this long (seconds) while none is gone: a killed process closes its
                sockets, failing its peers' collectives, a moment before it is a zombie. (Default: ``0``)
        """
        if self._store is None:
            return []
        try:
            records = read_records(self._store, self.world_size)
        except Exception:  # noqa: BLE001 - a question asked while failing: no answer rather than another error
            return []
        others = [rec for r, rec in sorted(records.items()) if r != self.rank and not rec.done]
        deadline = time.monotonic() + wait
        while True:
            found = [rec for rec in others if _process_state(rec) in ("gone", "Z", "X")]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.005)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the watchdog thread -------------------------------------------------------------------------
    def _key(self, what: str) -> str:
        return _PREFIX + what

    def _record(self, stalled: float, done: bool) -> RankRecord:
        regions = self._regions[:]
        kind, name, waits = regions[-1] if regions else ("", "", False)
        busy = self._busy[-1] if self._busy else ("first step" if self._steps_seen == 1 else None)
        if not regions:
            waits = self._phase_waits
        return RankRecord(
            rank=self.rank, pid=self._pid, host=self._host, start=self._start, beat=self._beat,
            events=self._events, step=self._step, phase=self._phase,
            where=(f"{kind} ({name})" if name else kind) if regions else None, waiting=waits, busy=busy,
            stalled=round(stalled, 3), done=done,
        )

    def _publish(self, stalled: float, done: bool) -> None:
        if self._store is None:
            raise AssertionError(f"rank {self.rank}: the watchdog publishes before it started")
        self._beat += 1
        rec = self._record(stalled, done)
        self._store.set(self._key(f"rank/{self.rank}"), json.dumps(rec.__dict__))

    def _read_all(self) -> dict[int, RankRecord]:
        if self._store is None:
            raise AssertionError(f"rank {self.rank}: the watchdog reads before it started")
        return read_records(self._store, self.world_size)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # noqa: BLE001 - the watchdog must never take the training down
            log.exception("rank %d: the watchdog failed and stopped watching", self.rank)

    def _watch(self) -> None:
        now = time.monotonic()
        last_tick = now
        last_events, last_change = self._events, now
        first: tuple[float, dict[int, RankRecord]] | None = None
        warned_at = 0.0
        gap = max(5 * self.interval, 3.0)
        published, published_step = now, self._step
        while not self._stopping.wait(min(self.interval, _STEP_POLL)):
            now = time.monotonic()
            if now - last_tick > gap:  # this process was paused (Ctrl-Z, an overloaded machine): count anew
                last_change, first = now, None
            last_tick = now
            if now - published < self.interval:
                if self._step != published_step:  # a new step: tell the store soon (a launcher names it)
                    published_step = self._step
                    try:
                        self._publish(0.0, done=False)
                    except Exception as exc:  # noqa: BLE001
                        self._store_trouble(now, exc)
                continue
            published, published_step = now, self._step
            if self._events != last_events:
                last_events, last_change, first = self._events, now, None
            stalled = now - last_change
            try:
                self._publish(stalled, done=False)
                fired = self._store.add(self._key("fired"), 0) if self._store is not None else 0
                self._store_failing_since = None
            except Exception as exc:  # noqa: BLE001 - a store that fails must not stop the watch
                self._store_trouble(now, exc)
                continue
            if fired:
                self._follow()
                return
            if stalled < self.timeout / 2:
                continue
            try:
                if first is None:
                    first = (now, self._read_all())
                    continue
                if stalled < self.timeout or now - first[0] < self.timeout / 2 - self.interval:
                    continue
                second = self._read_all()
            except Exception as exc:  # noqa: BLE001
                self._store_trouble(now, exc)
                continue
            verdict = self._judge(first[1], second)
            if verdict is not None:
                self._fire(verdict, first[1], second, stalled, now - first[0])
                return
            if now - warned_at >= self.timeout:
                warned_at = now
                log.warning("rank %d has made no progress for %.0f s (%s); %s", self.rank, stalled,
                            second[self.rank].position() if self.rank in second else "?", _busy_text(second))
            first = (now, second)

    def _store_trouble(self, now: float, exc: Exception) -> None:
        if self._store_failing_since is None:
            self._store_failing_since = now
        elif now - self._store_failing_since >= self.timeout:
            log.warning("rank %d: the watchdog cannot reach the store for %.0f s (%s: %s); still trying",
                        self.rank, now - self._store_failing_since, type(exc).__name__, exc)
            self._store_failing_since = now

    def _judge(self, first: dict[int, RankRecord], second: dict[int, RankRecord]) -> _Verdict | None:
        """Who is stuck, from two snapshots at least ``timeout / 2`` apart; ``None``: nobody (yet)."""
        me = second.get(self.rank)
        if me is None:
            return None
        others = [r for r in range(self.world_size) if r != self.rank]
        not_running = tuple(r for r in others if r not in second or (
            r in first and first[r].beat == second[r].beat and not second[r].done))
        if not_running:
            return _Verdict(not_running, "not running")
        if not me.waiting:
            return None
        stalled = {r: rec for r, rec in second.items() if rec.stalled >= self.timeout / 2 and not rec.done}
        left = tuple(r for r in others if second[r].done)
        blocked = tuple(r for r in others if r in stalled and not stalled[r].waiting and not stalled[r].busy)
        if blocked or left:
            return _Verdict(tuple(sorted(blocked + left)), "blocked")
        if self.world_size > 1 and len(stalled) == self.world_size and all(
                rec.waiting and not rec.busy for rec in stalled.values()):
            places = Counter((rec.step, rec.where) for rec in stalled.values())
            top = places.most_common()
            if len(top) == 1:  # in a known region (not a phase's compute, e.g. a long optimizer step)
                return _Verdict(tuple(range(self.world_size)), "same collective") if top[0][0][1] else None
            if top[0][1] == top[1][1]:
                return _Verdict(tuple(range(self.world_size)), "different collectives")
            return _Verdict(tuple(r for r, rec in stalled.items() if (rec.step, rec.where) != top[0][0]),
                            "different collectives")
        return None

    def _fire(self, verdict: _Verdict, first: dict[int, RankRecord], second: dict[int, RankRecord],
              stalled: float, window: float) -> None:
        store = self._store
        if store is None:
            raise AssertionError(f"rank {self.rank}: the watchdog fires before it started")
        try:
            claimed = store.add(self._key("fired"), 1) == 1
        except Exception:  # noqa: BLE001 - no store: end this rank alone, saying why
            claimed = True
        if not claimed:
            self._follow()
            return
        try:
            store.set(self._key("stuck"), json.dumps(list(verdict.stuck)))
        except Exception:  # noqa: BLE001
            pass
        running = [r for r in verdict.stuck if verdict.reason != "not running" and r != self.rank]
        if self.rank in verdict.stuck:
            self._write_stack()
        stacks = self._collect_stacks(running)
        if self.rank in verdict.stuck:
            stacks[self.rank] = _main_stack(self._watched)
        message = self._message(verdict, second, stacks, stalled, window)
        try:
            store.set(self._key("report"), message)
        except Exception:  # noqa: BLE001
            pass
        self._end(WatchdogReport(message, verdict.stuck, reporter=True), kill=[
            second[r] for r in verdict.stuck if verdict.reason == "not running" and r in second])

    def _collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2 * self.interval + 1.0
        while ranks and time.monotonic() < deadline:
            for r in list(ranks):
                key = self._key(f"stack/{r}")
                try:
                    if self._store is not None and self._store.check([key]):
                        stacks[r] = self._store.get(key).decode(errors="replace")
                        ranks.remove(r)
                except Exception:  # noqa: BLE001
                    ranks.remove(r)
            time.sleep(0.05)
        return stacks

    def _write_stack(self) -> None:
        try:
            if self._store is not None:
                self._store.set(self._key(f"stack/{self.rank}"), _main_stack(self._watched))
        except Exception:  # noqa: BLE001
            pass

    def _follow(self) -> None:
        """Another rank ended the run: give it this rank's stack if it asks, wait for its message, exit."""
        store = self._store
        message = ""
        deadline = time.monotonic() + 2 * self.interval + 6.0
        stuck: tuple[int, ...] = ()
        asked = False
        while store is not None and time.monotonic() < deadline:
            try:
                if not asked and store.check([self._key("stuck")]):
                    stuck = tuple(json.loads(store.get(self._key("stuck"))))
                    asked = True
                    if self.rank in stuck:
                        self._write_stack()
                if store.check([self._key("report")]):
                    message = store.get(self._key("report")).decode(errors="replace")
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)
        self._end(WatchdogReport(message or "the watchdog of another rank ended the run", stuck, reporter=False),
                  kill=[])

    def _end(self, report: WatchdogReport, kill: list[RankRecord]) -> None:
        try:
            if self.on_timeout is not None:
                self.on_timeout(report)
            elif report.reporter:
                log.error("%s", report.message)
        except Exception:  # noqa: BLE001 - the run ends whatever the handler does
            log.exception("rank %d: the watchdog's on_timeout raised", self.rank)
        for rec in kill:  # a stopped process ignores SIGTERM until continued: end it (same host only)
            if _process_state(rec) == "T":
                try:
                    os.kill(rec.pid, signal.SIGKILL)
                except OSError:
                    pass
        _flush()
        os._exit(self.exit_code)

    def _message(self, verdict: _Verdict, second: dict[int, RankRecord], stacks: dict[int, str],
                 stalled: float, window: float) -> str:
        names = ", ".join(map(str, verdict.stuck))
        what = {
            "not running": "does not run" if len(verdict.stuck) == 1 else "do not run",
            "blocked": "makes no progress outside any collective" if len(verdict.stuck) == 1
            else "make no progress outside any collective",
            "different collectives": "waits in another collective than the others" if len(verdict.stuck) == 1
            else "wait in different collectives",
            "same collective": "wait in the same collective and none completes",
        }[verdict.reason]
        plural = "s" if len(verdict.stuck) > 1 else ""
        lines = [f"watchdog: rank{plural} {names} {what}; rank {self.rank} waited {stalled:.0f} s "
                 f"(timeout {self.timeout:g} s). Every rank:"]
        for r in range(self.world_size):
            rec = second.get(r)
            if r in verdict.stuck and verdict.reason == "not running":
                state = _not_running_text(rec)
                last = f"; last seen at {rec.position()}" if rec is not None else ""
                lines.append(f"  rank {r}: STUCK, {state}; no sign of life for {window:.0f} s{last}")
                continue
            if rec is None:
                lines.append(f"  rank {r}: no record")
                continue
            if rec.done:
                status = f"left the run (its watchdog stopped) at {rec.position()}"
            elif rec.stalled >= self.timeout / 2:
                status = (f"{'waiting' if rec.waiting else 'no progress'} for {rec.stalled:.0f} s at "
                          f"{rec.position()}")
            else:
                status = f"progressing, at {rec.position()}"
            tag = "STUCK, " if r in verdict.stuck else ""
            lines.append(f"  rank {r} (pid {rec.pid}): {tag}{status}")
        for r in verdict.stuck:
            if r in stacks:
                lines.append(f"rank {r}'s Python stack (most recent call last):")
                lines.append(stacks[r].rstrip())
            elif verdict.reason != "not running":
                lines.append(f"rank {r}'s Python stack: not received")
        return "\n".join(lines)


def _busy_text(records: dict[int, RankRecord]) -> str:
    busy = [f"rank {r} is busy ({rec.busy}, {rec.position()})" for r, rec in sorted(records.items())
            if rec.busy and not rec.done]
    if busy:
        return "; ".join(busy) + ": not ending the run"
    return "no rank is known to be stuck yet: not ending the run"


def _main_stack(ident: int, limit: int = 30) -> str:
    """The stack of thread ``ident``, without the process start-up's frames (multiprocessing's spawn)."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return "  (the thread has ended)"
    frames = traceback.extract_stack(frame)
    while len(frames) > 1 and (frames[0].filename == "<string>" or f"multiprocessing{os.sep}" in frames[0].filename):
        frames.pop(0)
    return "".join(traceback.format_list(frames[-limit:]))


def _flush() -> None:
    for handler in logging.getLogger().handlers + logging.getLogger("shardwise").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def read_records(store: Store, world_size: int) -> dict[int, RankRecord]:
    """Every rank's last published record (ranks that published none are
    absent), e.g. for a launcher that wants a failed rank's step.

    Args:
        store: the store the watchdogs publish to.
        world_size: the number of ranks.
    """
    keys = [_PREFIX + f"rank/{r}" for r in range(world_size)]
    if store.check(keys):
        return {r: RankRecord.from_json(raw) for r, raw in enumerate(store.multi_get(keys))}
    return {r: RankRecord.from_json(store.get(k)) for r, k in enumerate(keys) if store.check([k])}


def read_report(store: Store) -> str | None:
    """The message of a watchdog that ended the run, if one did (for a launcher that prints it).

    Args:
        store: the store the watchdogs publish to.
    """
    key = _PREFIX + "report"
    return store.get(key).decode(errors="replace") if store.check([key]) else None


_ACTIVE: Watchdog | None = None


def active() -> Watchdog | None:
    """The watchdog running in this process, if any."""
    return _ACTIVE


def step(n: int) -> None:
    """:meth:`Watchdog.step` on the running watchdog; nothing if none runs."""
    if _ACTIVE is not None:
        _ACTIVE.step(n)


def phase(name: str | None, *, waits: bool = False) -> None:
    """:meth:`Watchdog.phase` on the running watchdog; nothing if none runs."""
    if _ACTIVE is not None:
        _ACTIVE.phase(name, waits=waits)


@contextmanager
def busy(what: str) -> Iterator[None]:
    """:meth:`Watchdog.busy` on the running watchdog; nothing if none runs."""
    wd = _ACTIVE
    if wd is None:
        yield
        return
    with wd.busy(what):
        yield


@contextmanager
def collective(name: str) -> Iterator[None]:
    """:meth:`Watchdog.collective` on the running watchdog; nothing if none runs."""
    wd = _ACTIVE
    if wd is None:
        yield
        return
    with wd.collective(name):
        yield
